"""The worker-side contract: what one training process reads to join its process group.

Only torchrun's per-worker variables are read (a table, like submitit's `JobEnvironment`);
everything launcher-specific (`PET_*`, `SLURM_*`, ...) is `trainer.launch`'s business. None of
them set means a single process without a process group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from trainer.config import ConfigError
from trainer.contract import LAUNCH_COMMAND

# field -> the variable that carries it, and whether it is required for a multi-process run
WORKER_ENV = {
    "rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
}


#: How long a rank other than 0 polls for rank 0's store before it leaves it to torch (`wait_for_store`).
STORE_POLL_S = 30.0


class DistEnvError(ConfigError):
    """The worker variables are inconsistent; the message names the variable and the fix."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def distributed(self) -> bool:
        """True when a process group is needed (set by a launcher, even for world size 1)."""
        return self.master_addr is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], var: str, default: int) -> int:
    raw = env.get(var)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistEnvError(f"{var}={raw!r} is not an integer; the launcher must set a number") from None


def read_dist_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Parse the six torchrun variables; raise `DistEnvError` on inconsistent values."""
    env = os.environ if env is None else env
    present = [v for v in WORKER_ENV.values() if env.get(v)]
    if not present:
        return DistEnv()
    world_size = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", 1)
    if world_size < 1:
        raise DistEnvError(f"WORLD_SIZE={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise DistEnvError(
            f"RANK={rank} is not in [0, WORLD_SIZE={world_size}); a rank is a process index, "
            f"not a node index (start through `{LAUNCH_COMMAND}`)"
        )
    if not 0 <= local_rank < max(local_world_size, 1):
        raise DistEnvError(f"LOCAL_RANK={local_rank} is not in [0, LOCAL_WORLD_SIZE={local_world_size})")
    addr = env.get("MASTER_ADDR") or None
    if addr is None and world_size > 1:
        raise DistEnvError(f"MASTER_ADDR is not set but WORLD_SIZE={world_size}; set it to rank 0's host")
    if addr is None:  # WORLD_SIZE=1 with no master: a plain single process
        return DistEnv(rank=0, world_size=1, local_rank=local_rank, local_world_size=local_world_size)
    port = _int(env, "MASTER_PORT", 0)
    if not 0 < port < 65536:
        raise DistEnvError(f"MASTER_PORT={env.get('MASTER_PORT')!r} must be a port in 1..65535")
    return DistEnv(rank, world_size, local_rank, local_world_size, addr, port)


def gpu_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """The GPU of a rank: its local rank; fewer visible GPUs than local ranks is an error now,
    not two ranks sharing a GPU (and an NCCL failure) later."""
    if visible < local_world_size:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DistEnvError(
            f"{local_world_size} ranks on this node but {visible} GPU(s) visible"
            + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
            + ": one rank per GPU; set gpus_per_node to the GPUs the node has, or ask the "
            "scheduler for more"
        )
    return local_rank


def pick_device(denv: DistEnv, want: str = "auto", gpus_per_node: int | None = None):
    """`cuda:LOCAL_RANK` when CUDA is wanted and present, else CPU.

    `gpus_per_node` is the job file's (None: no job file): a job that asked for GPUs and sees
    none stops here with what was looked at (it would otherwise train on CPU, exit 0); a CPU
    job (0) trains on CPU whatever the node has, as `device: auto` means for it."""
    import torch

    if gpus_per_node and want != "cpu" and not torch.cuda.is_available():
        from trainer.gpus import gather

        raise DistEnvError(f"gpus_per_node is {gpus_per_node} but torch sees no GPU here ({gather().describe()}); "
                           "run the job where its GPUs reach the container, or set gpus_per_node: 0")
    if want == "cuda" and not torch.cuda.is_available():
        raise DistEnvError("train.device is cuda but no CUDA device is visible; use device: auto or cpu")
    if gpus_per_node == 0 and want == "auto":
        return torch.device("cpu")
    if want in ("auto", "cuda") and torch.cuda.is_available():
        index = gpu_index(denv.local_rank, denv.local_world_size, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(denv: DistEnv, device, timeout_s: int = 600) -> Iterator[None]:
    """Join the process group (nccl on CUDA, else gloo) and destroy it on every exit path."""
    import torch.distributed as dist

    if not denv.distributed:
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if denv.is_main:
        logging.getLogger("ddpkit.trainer").info(
            "joining the process group: %d ranks, %s, master %s:%s", denv.world_size, backend,
            denv.master_addr, denv.master_port)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if not denv.is_main and not agent_store:
        # bounded: past it, torch's own (slower) retries go on for the whole timeout_s
        wait_for_store(denv.master_addr, denv.master_port, min(timeout_s, STORE_POLL_S))
    # env:// (the default) reads the six variables; under torchrun it also joins the agent's
    # store (TORCHELASTIC_USE_AGENT_STORE) instead of binding MASTER_PORT a second time.
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    # Rank 0's process hosts the store unless torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE;
    # ddpkit's launcher turns the sharing off: trainer/launch/plan.py), as in Slurm srun mode. Were
    # rank 0 to exit while another rank is still tearing its group down, that rank aborts
    # ("terminate called without an active exception": 4 tests in two runs on the loaded 2-core
    # machine), a failed rank for torchrun and Slurm alike. So after a clean run rank 0 leaves
    # only once every rank said its group is gone; after an error nobody waits (a dead peer
    # would hold a restart up).
    store = None if agent_store else dist.distributed_c10d._get_default_store()
    try:
        yield
    except BaseException:
        leave_after_error(dist)
        raise
    if dist.is_initialized():
        dist.destroy_process_group()
    if store is not None:
        _leave_together(store, denv, timeout_s=min(timeout_s, 60))


def leave_after_error(dist) -> None:
    """Tear the group down after an exception without waiting on the peers. With NCCL,
    `destroy_process_group()` (torch 2.13: `shutdown()`) waits for the rank's queued kernels,
    and one that waits on a peer that died mid-all-reduce never finishes: the rank would sit
    there for the whole collective timeout (`train.timeout_s`) with the hang watchdog already
    stopped. Aborting the communicators returns at once; gloo's teardown never waits on a peer."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def wait_for_store(host: str, port: int, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Until rank 0's store accepts a TCP connection (True), at most `timeout_s` (False).

    A TCPStore client that finds nobody listening yet retries after about half a second (torch
    2.13: 0.56 s when the store came up 0.05 s later), and on a restart every rank starts at
    the same moment, so rank 0's store is rarely up first: polling every `poll_s` makes the
    group form as soon as it is (the store closes the probe's connection as a client's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def _leave_together(store, denv: DistEnv, timeout_s: float) -> None:
    """Ranks other than 0 say they are done; rank 0 waits for them (bounded), then returns."""
    key = "ddpkit/left/{}"
    try:
        if not denv.is_main:
            store.set(key.format(denv.rank), "1")
        else:
            store.wait([key.format(r) for r in range(1, denv.world_size)],
                       datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001  (a peer that died, a store gone: leaving anyway is right)
        pass
