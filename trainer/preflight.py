"""Preflight: is this node's distributed setup sound? One verdict line per node.

    python -m trainer.preflight            # on every node, like `python -m trainer.launch`

and `preflight: true` in a job file runs the same checks before training on every target (the
launcher runs each worker as `python -m trainer.preflight --then <entry>`: the checks, then the
real entry in the same process).

What is checked, and the failure line for each way it can go wrong:
- the master: `trainer.launch` resolves and TCP-connects the rendezvous endpoint before
  torchrun starts (`wait_for_master`: "master host ... does not resolve", "... port closed");
  each worker then reaches the worker store at MASTER_ADDR:MASTER_PORT (connect time reported);
- the world layout: WORLD_SIZE against what the job asked for (`DDPKIT_NNODES` x
  `DDPKIT_NPROC_PER_NODE`): "world size 2, but the job asks for 3 (1 node x 3 processes)";
- the device, by the trainer's own rule (`trainer.dist.pick_device`): a GPU job whose rank sees
  no GPU (what was looked at: trainer/gpus.py), fewer GPUs than ranks, `train.device: cuda`
  with no GPU visible; and ranks that disagree on cuda/cpu (and so on nccl/gloo), named by host
  and rank;
- an all-reduce: the sum must be exact; its time gives a bus bandwidth figure
  (2 (n-1)/n x bytes / seconds, as nccl-tests report it);
- the transport: gloo's TCP interface; with NCCL the network NCCL chose (IB, Socket, ...) from
  its own INIT/NET log (`NCCL_DEBUG_FILE`).

The checks run on their own gloo/NCCL process group objects over a prefixed store, not on the
default group, so the training that follows in the same process starts clean.
Exit codes: 0 all good, 1 a check failed.
"""

from __future__ import annotations

import datetime
import glob
import os
import runpy
import socket
import sys
import tempfile
import time
from typing import Any

from trainer.contract import (
    CONTEXT_VAR,
    EXIT_FAILURE,
    EXIT_OK,
    LAUNCH_COMMAND,
    NNODES_VAR,
    NPROC_PER_NODE_VAR,
    PREFLIGHT_ONLY_VAR,
)

EXIT_FAILED = EXIT_FAILURE  # a check failed
PREFIX = "ddpkit-preflight"
#: The timed all-reduce's size: on GPUs past where NCCL's bus bandwidth levels off (nccl-tests'
#: curves flatten in the hundreds of MiB across nodes; 64 MiB read low), on CPU small (gloo).
ALLREDUCE_BYTES_CUDA = 512 << 20
ALLREDUCE_BYTES_CPU = 8 << 20
_KEEP: list[Any] = []  # the worker store, alive as long as the process (see run_checks)


class PreflightError(Exception):
    """One line: what is wrong and what to do."""


def expected_world(env: dict[str, str]) -> tuple[int, int, int, int] | None:
    """(min world, max world, nnodes min, nproc) from the launch contract, if it is set."""
    nnodes, nproc = env.get(NNODES_VAR), env.get(NPROC_PER_NODE_VAR)
    if not nnodes or not nproc or not nproc.isdigit():
        return None
    lo, _, hi = nnodes.partition(":")
    if not lo.isdigit() or not (hi or lo).isdigit():
        return None
    return int(lo) * int(nproc), int(hi or lo) * int(nproc), int(lo), int(nproc)


def check_world(world: int, env: dict[str, str]) -> None:
    want = expected_world(env)
    if want is None:
        return
    lo, hi, nodes, nproc = want
    if not lo <= world <= hi or world % nproc:
        asked = (f"{lo}" if lo == hi else f"{lo}..{hi}") + f" ({env[NNODES_VAR]} node(s) x {nproc} processes)"
        raise PreflightError(
            f"world size {world}, but the job asks for {asked}: the launcher that started the workers "
            f"disagrees with the job file (start through `{LAUNCH_COMMAND}`, or fix nodes/procs_per_node)")


def device_of(env: dict[str, str], want: str, gpus_per_node: int | None) -> Any:
    """The device this rank trains on, chosen and set by the trainer's own rule
    (`trainer.dist.pick_device`: one rank per GPU, a GPU job that sees none stops);
    PreflightError when it cannot."""
    from trainer.dist import DistEnvError, pick_device, read_dist_env

    try:
        return pick_device(read_dist_env(env), want, gpus_per_node)
    except DistEnvError as e:
        raise PreflightError(f"on {socket.gethostname()}: {e}") from None


def nccl_network(log_dir: str) -> str:
    """The network NCCL says it uses (`NET/IB`, `NET/Socket`, ...) from its INIT/NET log."""
    found: list[str] = []
    for path in glob.glob(os.path.join(log_dir, "nccl.*")):
        with open(path, errors="replace") as f:
            for line in f:
                if "Using network" in line:
                    found.append(line.split("Using network", 1)[1].strip())
                elif "NET/" in line and " : Using " in line:
                    found.append(line.split("NET/", 1)[1].strip())
    return "; ".join(dict.fromkeys(found)) or "unknown (NCCL logged no network line)"


def run_checks(env: dict[str, str], want_device: str, timeout_s: int,
               gpus_per_node: int | None = None) -> dict[str, Any]:
    """This rank's part: store, layout, backend, all-reduce. Returns the node's facts."""
    import torch

    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", "0"))
    check_world(world, env)
    device = device_of(env, want_device, gpus_per_node)
    kind, backend = device.type, "nccl" if device.type == "cuda" else "gloo"
    nccl_logs, nccl_env = nccl_debug_logs() if backend == "nccl" else (None, {})
    store, store_ms = open_store(env, rank, world, timeout_s)
    pg = process_group(store, backend, rank, world, timeout_s)
    layout = check_layout(store, rank, world, f"{socket.gethostname()}|{local_rank}|{kind}|{backend}")
    nbytes, seconds = allreduce(pg, device, rank, world, backend)
    restore_env(nccl_env)
    busbw = (2 * (world - 1) / world * nbytes / seconds / 1e9) if world > 1 else None
    if backend == "nccl":
        transport = f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, network {nccl_network(nccl_logs)}"
    else:
        transport = f"gloo TCP (interface {os.environ.get('GLOO_SOCKET_IFNAME') or 'default route'})"
    hosts: dict[str, list[int]] = {}
    for r, row in enumerate(layout):
        hosts.setdefault(row[0], []).append(r)
    # Everyone waits until every rank is done before the objects go away.
    store.add("done", 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add("done", 0)) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    del pg
    return {"store_ms": store_ms, "world": world, "nodes": len(hosts), "hosts": hosts, "device": str(device),
            "backend": backend, "transport": transport, "allreduce_mib": nbytes >> 20,
            "allreduce_ms": seconds * 1000, "busbw_gbs": busbw}


def nccl_debug_logs() -> tuple[str, dict[str, str | None]]:
    """A folder for NCCL's INIT/NET log (NCCL reads these once, at its first communicator in the
    process), which `nccl_network` reads, and the variables as they were before (`restore_env`):
    the training that follows in this process and its children get the job's own again (NCCL
    itself keeps what it read: its INIT/NET lines of the training go to the same file)."""
    nccl_logs = tempfile.mkdtemp(prefix="ddpkit-preflight-nccl-")
    settings = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                "NCCL_DEBUG_FILE": os.path.join(nccl_logs, "nccl.%h.%p")}
    before = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        os.environ.setdefault(name, value)
    return nccl_logs, before


def restore_env(before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def open_store(env: dict[str, str], rank: int, world: int, timeout_s: int) -> tuple[Any, float]:
    """The worker store at MASTER_ADDR:MASTER_PORT (rank 0 hosts it unless torchrun's agent
    does), prefixed for this attempt, and the milliseconds it took."""
    import torch.distributed as dist

    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    t = time.perf_counter()
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(addr, port, world, is_master=rank == 0 and not agent_store,
                              timeout=datetime.timedelta(seconds=timeout_s), multi_tenant=True,
                              wait_for_workers=False)
    except Exception as e:  # noqa: BLE001  (RuntimeError/DistNetworkError: message is the point)
        raise PreflightError(f"worker store {addr}:{port} not reachable: {str(e).splitlines()[0]}") from None
    store_ms = (time.perf_counter() - t) * 1000
    # Rank 0 hosts the store for the whole process: the training's init_process_group joins the
    # same multi-tenant server (same port). Dropping it here would close it under the other
    # ranks, which may already be connecting to it for the training.
    _KEEP.append(store)
    store = dist.PrefixStore(f"{PREFIX}/{env.get('TORCHELASTIC_RUN_ID', '')}/"
                             f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store, store_ms


def process_group(store: Any, backend: str, rank: int, world: int, timeout_s: int) -> Any:
    """A gloo or NCCL process group object of its own (not the default group)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def check_layout(store: Any, rank: int, world: int, me: str) -> list[list[str]]:
    """Every rank's host, local rank, device kind and backend, through the store (no pickling on
    the group); PreflightError when the ranks disagree on the device kind."""
    store.set(f"layout/{rank}", me)
    layout = [store.get(f"layout/{r}").decode().split("|") for r in range(world)]
    kinds = {r: row[2] for r, row in enumerate(layout)}
    if len(set(kinds.values())) > 1:
        odd = [f"rank {r} on {layout[r][0]}: {k}" for r, k in kinds.items() if k != kinds[0]]
        raise PreflightError(f"ranks disagree on the device (rank 0: {kinds[0]}; {', '.join(odd)}): one backend "
                             "needs one device kind everywhere; give every node the same GPUs or use train.device cpu")
    return layout


def allreduce(pg: Any, device: Any, rank: int, world: int, backend: str) -> tuple[int, float]:
    """An exact sum first, then timed rounds: (bytes per all-reduce, seconds per round)."""
    import torch

    cuda = device.type == "cuda"
    probe = torch.full((4,), float(rank + 1), device=device)
    pg.allreduce([probe]).wait()
    if cuda:
        torch.cuda.synchronize()
    want_sum = world * (world + 1) / 2
    if probe.tolist() != [want_sum] * 4:
        raise PreflightError(f"all-reduce gave {probe.tolist()[0]}, expected {want_sum}: the {backend} transport corrupts data")
    nbytes = ALLREDUCE_BYTES_CUDA if cuda else ALLREDUCE_BYTES_CPU
    buf = torch.ones(nbytes // 4, device=device)
    pg.allreduce([buf]).wait()  # warm-up (connections, buffers)
    rounds = 5
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(rounds):
        pg.allreduce([buf]).wait()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t) / rounds
    del buf
    if cuda:
        torch.cuda.empty_cache()  # the training that follows gets the memory back
    return nbytes, seconds


def verdict_ok(node: str, facts: dict[str, Any], env: dict[str, str]) -> str:
    here = facts["hosts"].get(socket.gethostname(), [])
    bw = f"{facts['busbw_gbs']:.2f} GB/s bus bandwidth" if facts["busbw_gbs"] is not None else "1 rank, no traffic"
    return (f"ddpkit preflight: node {node} ({socket.gethostname()}): OK: store {env['MASTER_ADDR']}:"
            f"{env['MASTER_PORT']} in {facts['store_ms']:.0f} ms; world {facts['world']} on {facts['nodes']} "
            f"host(s), ranks {here[0]}-{here[-1]} here; {facts['backend']} on {facts['device']}, "
            f"{facts['transport']}; all-reduce {facts['allreduce_mib']} MiB {facts['allreduce_ms']:.1f} ms, {bw}")


def worker(then: list[str]) -> int:
    """Inside a worker (RANK etc. set): the checks; then `then` (an entry) in this process."""
    from trainer.config import load_job_sections

    env = dict(os.environ)
    node = env.get("GROUP_RANK") or env.get("SLURM_NODEID") or "?"
    try:
        sections = load_job_sections()
        facts = run_checks(env, sections.train.device, min(sections.train.timeout_s, 300), sections.gpus_per_node)
    except PreflightError as e:
        print(f"ddpkit preflight: node {node} ({socket.gethostname()}) rank {env.get('RANK')}: FAILED: {e}",
              file=sys.stderr, flush=True)
        return EXIT_FAILED
    if env.get("LOCAL_RANK", "0") == "0":
        print(verdict_ok(node, facts, env), flush=True)
    if not then:
        return EXIT_OK
    # The entry: `-m module args...` or `script args...`, as torchrun would have run it.
    if then[0] == "-m":
        sys.argv = [then[1], *then[2:]]
        runpy.run_module(then[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(then)
        runpy.run_path(then[0], run_name="__main__")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    then = argv[argv.index("--then") + 1:] if "--then" in argv else []
    # A worker: under torchrun, or a Slurm task the launcher turned into one. (A PyTorchJob pod
    # has RANK and MASTER_ADDR too, but for the node: that is the launcher's business.)
    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(CONTEXT_VAR) == "slurm-srun":
        return worker(then)
    # On a node: the launcher, with the checks as the worker entry.
    os.environ[PREFLIGHT_ONLY_VAR] = "1"
    from trainer.launch.node import main as launch_main

    return launch_main()


if __name__ == "__main__":
    sys.exit(main())
