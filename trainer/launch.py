"""The node-level entry point every target starts: `python -m trainer.launch`.

It turns what a node sees (the scheduler's variables plus the `DDPKIT_*` ones a renderer sets,
docs/CONTRACT.md) into one torchrun invocation, or, in Slurm srun-per-GPU mode, into the six
per-worker variables `trainer.dist` reads. Which variable carries which fact in which context
is a table (`CONTEXTS`), not a maze of ifs; `plan_launch` is a pure function of the
environment, tested context by context.

Precedence, per field: the first source in the table's tuple that is set wins. `DDPKIT_*`
values come first because they are rendered from the job file (the one source of topology);
a scheduler variable that disagrees is reported and ignored. Stale worker variables that an
image or a controller pre-set (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ..., `PET_*`) are removed
before torchrun starts, and reported, so torchrun sees exactly the flags we log.

Non-master nodes first wait for the master's rendezvous port with a real TCP connect and a
bounded backoff (DNS answering is not enough), then fail with a message naming host:port.

torchrun runs as a supervised child rather than by exec: torchrun exits 1 after forwarding
SIGTERM to its workers, which would turn a clean preemption (workers checkpoint and exit 143)
into a permanent failure for Kubeflow's ExitCode policy. The shim forwards SIGTERM, SIGINT,
SIGHUP and SIGUSR2 (torchrun is told to forward USR2 too). Exit codes after a stop
(`trainer.contract`): `EXIT_STOPPED` (143) only when the workers wrote their stop checkpoint
(they say so through `DDPKIT_STOP_FILE`), `EXIT_STOPPED_UNSAVED` (137) when a stop signal
arrived but no checkpoint was written (killed mid-step or mid-save, or stopped before training
began); both are retryable (Kubeflow's ExitCode policy: 128-255; the sbatch script requeues on
any failure after its signal). torchrun waits `DDPKIT_STOP_GRACE_S` (the target's grace period:
terminationGracePeriodSeconds, the Slurm signal lead; default `DEFAULT_STOP_GRACE_S`) for the
workers' stop checkpoint before it kills them (`--shutdown-timeout`; torch's default of 30 s
would cut off a slow step or save whatever the grace period). Modes without torchrun exec the
trainer directly.

Restarts need a fresh worker store (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`). Since torch 2.4
the c10d rendezvous handler shares its own TCPStore with the workers, and in torch 2.13 it
creates that store once per agent and hands the same MASTER_PORT to every later round
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1209, `_bootstrap_store_info` is
only rebuilt when it is None). The workers connect to it as plain clients with no per-attempt
prefix (torch/distributed/rendezvous.py:189, "We create a new TCPStore for every retry so no
need to add prefix for each attempt", which no longer holds), and `init_process_group` uses
fixed keys (`PrefixStore("default_pg")`, group name "0" from a per-process counter:
distributed_c10d.py:1897 and :5492; gloo then stores `default_pg/0//cpu//0/<rank>`). So the
keys of the previous attempt are still there when a restarted group forms its mesh, and a rank
reads its peer's old address and dials a dead process ("Gloo connectFullMesh failed ...
Connection refused"; NCCL reads an old unique id the same way: pytorch/pytorch#135712). With
sharing off, every round picks a new port and rank 0 hosts a new, empty store: torch's own
opt-out, set here unless the node's environment sets it.

Warm restarts (trainer/warm.py has the design and the measurements that chose it): in torchrun
mode the shim also starts the node's template process, which imports torch and the trainer
(and builds a built-in workload) once, when the first worker is asked for (on a one-node job at
once, beside torchrun's own start), and torchrun runs `python -m trainer.warm ENTRY`, a
standard-library client that has the template fork the worker and then stands in for it (its
exit code or signal, stop signals forwarded, and a client that dies takes its worker with it).
A restart by torchrun then costs a fork, not `import torch` and `import torch._dynamo` again.
`train.warm_restarts` (default true) applies to the built-in trainer and preflight; a `script`
or `module` job starts cold unless the node sets `DDPKIT_WARM=1` (its imports and whether they
survive a fork are its own); `DDPKIT_WARM=0` starts every worker cold. The srun-per-GPU mode
execs the trainer cold as before: Slurm starts every task itself and restarts only by a requeue
or a new job step, where all processes are new (and may be on other nodes); a template there
would pay the same import once per step. Likewise a worker already under torchrun.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trainer import attempts, contract, gpus
from trainer.config import TRAINER_ENTRY

# The contract's names, also importable from here as before (deploy and the tests do).
from trainer.contract import (  # noqa: F401  (EXIT_OK: re-exported)
    CONTEXT_VAR,
    DEFAULT_PORT,
    DEFAULT_STOP_GRACE_S,
    EXIT_BAD_CONFIG,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_STOPPED_UNSAVED,
    JOB_FILE_VAR,
    LAUNCH_T0_VAR,
    LAUNCHER_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
    MAX_RESTARTS_VAR,
    NNODES_VAR,
    NPROC_PER_NODE_VAR,
    PREFLIGHT_ONLY_VAR,
    RESIDENT_VAR,
    RUN_DIR_VAR,
    RUN_ID_VAR,
    STOP_FILE_VAR,
    STOP_GRACE_S_VAR,
    TORCHRUN_T0_VAR,
    WARM_SOCKET_VAR,
    WARM_VAR,
    resident_socket,
)
from trainer.cpus import NODE_CPUS_VAR, format_cpus

Env = Mapping[str, str]
Source = str | Callable[[Env], "str | None"]

TRAINER = list(TRAINER_ENTRY)
PREFLIGHT = ["-m", "trainer.preflight"]
GUARD = ["-m", "trainer.guard"]  # a script job's workers: stacks on a stop, its exceptions recorded
WARM_CLIENT = ["-m", "trainer.warm"]  # the worker torchrun starts on the warm path (trainer/warm.py)
FRESH_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR2")
# Variables that describe one worker; stale copies in a node's environment are dropped.
WORKER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


class LaunchError(Exception):
    """A clear, one-line reason the node cannot start."""


# -- derived values ---------------------------------------------------------------------
def slurm_first_host(env: Env) -> str | None:
    """First host of the job's node list (not `hostname -i`, not the login node)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    import hostlist

    return hostlist.expand_hostlist(nodelist)[0]


def slurm_port(env: Env) -> str | None:
    """The port of the job `SLURM_JOB_ID` names, so jobs sharing a node do not collide on one
    port: `contract.slurm_port`, the formula the rendered sbatch script computes in bash."""
    job_id = env.get("SLURM_JOB_ID")
    return str(contract.slurm_port(int(job_id))) if job_id and job_id.isdigit() else None


def slurm_tasks_per_node(env: Env) -> str | None:
    """`SLURM_NTASKS_PER_NODE`, else the first count of `SLURM_TASKS_PER_NODE` ("2(x3),1")."""
    if env.get("SLURM_NTASKS_PER_NODE"):
        return env["SLURM_NTASKS_PER_NODE"]
    tpn = env.get("SLURM_TASKS_PER_NODE")
    return tpn.split("(")[0].split(",")[0] if tpn else None


def rdzv_endpoint(part: int) -> Callable[[Env], str | None]:
    """Host (0) or port (1) of `PET_RDZV_ENDPOINT` ("host:port")."""

    def get(env: Env) -> str | None:
        host, sep, port = (env.get("PET_RDZV_ENDPOINT") or "").rpartition(":")
        return (host.strip("[]"), port)[part] if sep and host and port else None

    return get


def hosts_endpoint(env: Env) -> str | None:
    """Node rank for contexts that give none: "0" when `HOSTNAME` is the endpoint's host.

    Kubernetes sets HOSTNAME to the pod's hostname, so the pod the endpoint names hosts the
    store. Any other pod gets no rank (c10d assigns ranks; it only has to join).
    """
    host, me = rdzv_endpoint(0)(env), env.get("HOSTNAME")
    if not host or not me:
        return None
    return "0" if host == me or host.split(".")[0] == me else "-1"


def skypilot_first_ip(env: Env) -> str | None:
    ips = (env.get("SKYPILOT_NODE_IPS") or "").split()
    return ips[0] if ips else None


def const(value: str) -> Callable[[Env], str]:
    """A default: used when no variable is set, never reported as a disagreement."""

    def default(env: Env) -> str:
        return value

    default.is_default = True  # type: ignore[attr-defined]
    return default


# -- the context table ------------------------------------------------------------------
@dataclass(frozen=True)
class Context:
    name: str
    detect: Callable[[Env], bool]
    node_rank: tuple[Source, ...] = ()
    nnodes: tuple[Source, ...] = ()
    nproc: tuple[Source, ...] = ()
    master_addr: tuple[Source, ...] = ()
    master_port: tuple[Source, ...] = ()
    mode: str = "torchrun"  # torchrun | direct (already a worker) | srun (one task per GPU)


def has(*names: str) -> Callable[[Env], bool]:
    return lambda env: all(env.get(n) for n in names)


# The contract's variables come first in every tuple below (the module docstring says why).
NNODES = (NNODES_VAR,)
NPROC = (NPROC_PER_NODE_VAR,)
ADDR = (MASTER_ADDR_VAR,)
PORT = (MASTER_PORT_VAR,)

CONTEXTS: tuple[Context, ...] = (
    # torchrun already started us (a user's own torchrun, or torchrun's restart): be the worker.
    Context("torchrun", has("TORCHELASTIC_RUN_ID"), mode="direct"),
    # Slurm, one task per GPU: srun started every worker; the six variables come from SLURM_*.
    Context(
        "slurm-srun",
        lambda e: bool(e.get("SLURM_PROCID")) and e.get(LAUNCHER_VAR) == "srun",
        node_rank=("SLURM_NODEID",),
        master_addr=(*ADDR, slurm_first_host),
        master_port=(*PORT, slurm_port),
        mode="srun",
    ),
    # Kubeflow Training Operator v1 PyTorchJob: PET_* plus RANK (= the POD index) and MASTER_*.
    Context(
        "kubeflow-pytorchjob",
        lambda e: bool(e.get("PET_NNODES") or e.get("PET_NPROC_PER_NODE")) and bool(e.get("RANK") or e.get("MASTER_ADDR")),
        node_rank=("PET_NODE_RANK", "RANK"),
        nnodes=(*NNODES, "PET_NNODES"),
        nproc=(*NPROC, "PET_NPROC_PER_NODE"),
        master_addr=("PET_MASTER_ADDR", "MASTER_ADDR"),
        master_port=("PET_MASTER_PORT", "MASTER_PORT"),
    ),
    # Kubeflow v1 PyTorchJob with an elasticPolicy: only PET_RDZV_ENDPOINT (`<job>-worker-0`),
    # PET_NNODES=min:max and PET_NPROC_PER_NODE; no rank, no master. The pod the endpoint names
    # hosts the store; the others wait for it.
    Context(
        "kubeflow-elastic",
        lambda e: bool(e.get("PET_RDZV_ENDPOINT")) and not e.get("PET_NODE_RANK") and not e.get("RANK"),
        node_rank=(hosts_endpoint,),
        nnodes=(*NNODES, "PET_NNODES"),
        nproc=(*NPROC, "PET_NPROC_PER_NODE"),
        master_addr=(rdzv_endpoint(0),),
        master_port=(rdzv_endpoint(1),),
    ),
    # Kubeflow Trainer v2 TrainJob: PET_* only (torchrun is mandatory there).
    Context(
        "kubeflow-trainjob",
        lambda e: bool(e.get("PET_NNODES") or e.get("PET_NODE_RANK")),
        node_rank=("PET_NODE_RANK",),
        nnodes=(*NNODES, "PET_NNODES"),
        nproc=(*NPROC, "PET_NPROC_PER_NODE"),
        master_addr=("PET_MASTER_ADDR",),
        master_port=("PET_MASTER_PORT",),
    ),
    # JobSet or Indexed Job: the pod index, everything else rendered.
    Context(
        "indexed-job",
        has("JOB_COMPLETION_INDEX"),
        node_rank=("JOB_COMPLETION_INDEX",),
        nnodes=NNODES,
        nproc=NPROC,
        master_addr=ADDR,
        master_port=PORT,
    ),
    # Slurm, one task per node running torchrun.
    Context(
        "slurm",
        has("SLURM_JOB_ID", "SLURM_NODEID"),
        node_rank=("SLURM_NODEID",),
        nnodes=(*NNODES, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
        nproc=NPROC,
        master_addr=(*ADDR, slurm_first_host),
        master_port=(*PORT, slurm_port),
    ),
    Context(
        "skypilot",
        has("SKYPILOT_NODE_RANK"),
        node_rank=("SKYPILOT_NODE_RANK",),
        nnodes=(*NNODES, "SKYPILOT_NUM_NODES"),
        nproc=(*NPROC, "SKYPILOT_NUM_GPUS_PER_NODE"),
        master_addr=(*ADDR, skypilot_first_ip),
        master_port=(*PORT, const(str(DEFAULT_PORT))),
    ),
    # Nothing known: one node (a laptop, `ddpkit run --local`, a plain container).
    Context(
        "local",
        lambda e: True,
        node_rank=(const("0"),),
        nnodes=(*NNODES, const("1")),
        nproc=(*NPROC, const("1")),
        master_addr=(*ADDR, const("127.0.0.1")),
        master_port=(*PORT, const(str(DEFAULT_PORT))),
    ),
)


@dataclass(frozen=True)
class CPUs:
    """What bounds the CPUs of this node's ranks: the process's affinity (srun binds a task to
    its CPUs; a pod usually sees the whole host), the container's cgroup quota, what the job
    asked for (`resources.cpus_per_node`) and `train.threads`."""

    affinity: int
    cgroup: float | None = None
    job: float | None = None
    threads: int | None = None
    ids: tuple[int, ...] = ()  # the CPUs of the affinity, when known (trainer/cpus.py splits them)


def cgroup_cpus(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU limit of this container: cgroup v2 `cpu.max` ("200000 100000" = 2 CPUs) or v1
    `cpu.cfs_quota_us`/`cpu.cfs_period_us`; None when unlimited or unknown."""
    try:
        quota, period = open(f"{root}/cpu.max").read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(open(f"{root}/cpu/cpu.cfs_quota_us").read())
        period = int(open(f"{root}/cpu/cpu.cfs_period_us").read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def threads_per_rank(env: Env, cpus: CPUs, ranks_on_node: int, one_task_per_rank: bool) -> tuple[str | None, str]:
    """`OMP_NUM_THREADS` for each rank (None: leave the user's) and why.

    `train.threads` wins (the worker sets it with `torch.set_num_threads` too), then the user's
    `OMP_NUM_THREADS`; else the tightest of: the
    affinity (shared by the node's ranks, except a srun task's, which is its own), Slurm's
    `SLURM_CPUS_PER_TASK` (likewise), the cgroup quota and `resources.cpus_per_node` (both per
    node, shared by its ranks). torchrun alone would set 1 for every rank.
    """
    if cpus.threads:
        return str(cpus.threads), f"{cpus.threads} (train.threads)"
    if env.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} (set by the job)"
    share = 1 if one_task_per_rank else max(1, ranks_on_node)
    per_node = max(1, ranks_on_node)
    bounds = {"affinity": cpus.affinity / share}
    task_cpus = env.get("SLURM_CPUS_PER_TASK", "")
    if task_cpus.isdigit() and int(task_cpus) > 0:
        bounds["SLURM_CPUS_PER_TASK"] = int(task_cpus) / share
    if cpus.cgroup:
        bounds["cgroup CPU quota"] = cpus.cgroup / per_node
    if cpus.job:
        bounds["resources.cpus_per_node"] = cpus.job / per_node
    source = min(bounds, key=bounds.get)
    value = max(1, int(bounds[source]))
    return str(value), f"{value} per rank (from {source})"


@dataclass
class NodePlan:
    """What this node will run: argv, its environment, whom to wait for, and what we decided."""

    context: str
    mode: str
    argv: list[str]
    env: dict[str, str]
    node_rank: int | None = 0  # None: not known on this node (elastic: c10d assigns ranks)
    wait_for: tuple[str, int] | None = None
    notes: list[str] = field(default_factory=list)
    warm: bool = False  # torchrun starts trainer.warm clients; a template forks the workers


def _resolve(env: Env, sources: tuple[Source, ...], what: str, notes: list[str]) -> str | None:
    """First source that yields a value; later disagreeing ones are noted."""
    chosen: tuple[str, str] | None = None
    for src in sources:
        value = src(env) if callable(src) else env.get(src)
        if value in (None, ""):
            continue
        label = src if isinstance(src, str) else "derived"
        if chosen is None:
            chosen = (label, str(value))
        elif str(value) != chosen[1] and not getattr(src, "is_default", False):
            notes.append(f"{what}: {label}={value} ignored, using {chosen[0]}={chosen[1]}")
    return None if chosen is None else chosen[1]


def _need(value: str | None, what: str, context: Context, sources: tuple[Source, ...]) -> str:
    if value is None:
        names = " or ".join(s for s in sources if isinstance(s, str)) or what
        raise LaunchError(f"{context.name}: {what} is unknown; set {names}")
    return value


def _int(value: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{what}={value!r} is not a number") from None


def _nnodes(value: str) -> str:
    parts = value.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise LaunchError(f"nnodes={value!r} must be N or MIN:MAX")
    return value


def _endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def detect_context(env: Env) -> Context:
    return next(c for c in CONTEXTS if c.detect(env))


def plan_launch(env: Env, python: str = sys.executable, run_id: str | None = None, timeout_s: int = 600,
                entry: list[str] | None = None, torchrun_args: list[str] = (), cpus: CPUs | None = None,
                warm: bool = False) -> NodePlan:
    """Pure: the environment of a node in, the command and environment to start out.

    `entry` is what each worker runs after `python` (torchrun takes the same words): the
    trainer (`-m trainer.train`, the default), or the job's own `script ARGS` / `-m module ARGS`.
    `torchrun_args` (the job's `torchrun_args`) go before it, after the launcher's own options.
    With `cpus`, the workers get `OMP_NUM_THREADS` from `threads_per_rank`. With `warm`, torchrun
    runs `-m trainer.warm ENTRY` (a client of the node's template process: trainer/warm.py);
    the modes without torchrun start cold.
    """
    entry = list(entry or TRAINER)
    ctx = detect_context(env)
    if ctx.mode == "direct":
        return NodePlan(ctx.name, "direct", [python, *entry], dict(env), notes=["already under torchrun"])
    notes: list[str] = []
    out, run_id = worker_env(env, ctx, run_id, notes)
    addr, port = resolve_master(env, ctx, notes)
    node_rank = resolve_node_rank(env, ctx, notes)
    if ctx.mode == "srun":
        return srun_plan(env, ctx, [python, *entry], out, (addr, port), node_rank, cpus, notes)

    nnodes, nproc = resolve_sizes(env, ctx, node_rank, cpus, out, notes)
    restarts = _int(_resolve(env, (MAX_RESTARTS_VAR, "PET_MAX_RESTARTS", const("0")), "max restarts", notes) or "0",
                    "max restarts")
    grace = resolve_stop_grace(env, notes)
    is_host = store_host(env, ctx, node_rank)
    argv = [
        python, "-m", "torch.distributed.run",
        "--nnodes", nnodes,
        "--nproc-per-node", nproc,
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", _endpoint(addr, port),
        "--rdzv-id", run_id,
        "--rdzv-conf", rdzv_conf(is_host, timeout_s, nnodes),
        "--max-restarts", str(restarts),
        "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2",
        "--shutdown-timeout", str(grace),
        *torchrun_args,
        *(WARM_CLIENT if warm else []),
        *entry,
    ]  # fmt: skip
    if warm:
        notes.append("warm restarts: the workers are forked from a template process that imports torch "
                     f"once ({WARM_VAR}=0: each worker starts cold)")
    return NodePlan(
        ctx.name, "torchrun", argv, out, node_rank=node_rank,
        wait_for=(addr, port) if is_host is False else None, notes=notes, warm=warm,
    )


# -- the pieces of a plan (each appends what it decided to `notes`) ---------------------------
def _value(env: Env, ctx: Context, sources: tuple[Source, ...], what: str, notes: list[str]) -> str:
    """The first of `sources` that is set (`_resolve`); a LaunchError naming them if none is."""
    return _need(_resolve(env, sources, what, notes), what, ctx, sources)


def worker_env(env: Env, ctx: Context, run_id: str | None, notes: list[str]) -> tuple[dict[str, str], str]:
    """The workers' environment (the node's, less stale worker variables) and the run id."""
    out = {k: v for k, v in env.items() if not k.startswith("PET_") and k not in WORKER_VARS}
    stale = sorted(k for k in env if k not in out)
    if stale:
        notes.append("removed from the worker environment (the launcher sets them): " + ", ".join(stale))
    run_id = env.get(RUN_ID_VAR) or run_id or "ddpkit"
    out[RUN_ID_VAR] = run_id
    if ctx.mode == "torchrun":  # a fresh worker store per rendezvous round (module docstring)
        out.setdefault(FRESH_STORE_VAR, "1")
        if out[FRESH_STORE_VAR] != "1":
            notes.append(f"{FRESH_STORE_VAR}={out[FRESH_STORE_VAR]} kept: a restarted group may "
                         "read the previous attempt's addresses and fail to connect")
    out[CONTEXT_VAR] = ctx.name
    return out, run_id


def resolve_master(env: Env, ctx: Context, notes: list[str]) -> tuple[str, int]:
    """The rendezvous endpoint: node 0's address and a port in 1..65535."""
    addr = _value(env, ctx, ctx.master_addr, "master address", notes)
    port = _int(_value(env, ctx, ctx.master_port, "master port", notes), "master port")
    if not 0 < port < 65536:
        raise LaunchError(f"master port {port} is not in 1..65535")
    return addr, port


def resolve_node_rank(env: Env, ctx: Context, notes: list[str]) -> int | None:
    """This node's index; None where c10d assigns it (elastic, not the endpoint's pod)."""
    rank_text = _resolve(env, ctx.node_rank, "node rank", notes)
    if ctx.name == "kubeflow-elastic":
        return None if rank_text in (None, "-1") else 0
    return _int(_need(rank_text, "node rank", ctx, ctx.node_rank), "node rank")


def set_threads(env: Env, cpus: CPUs | None, ranks_on_node: int, one_task_per_rank: bool,
                out: dict[str, str], notes: list[str]) -> None:
    """`OMP_NUM_THREADS` in `out` from `threads_per_rank` (nothing without `cpus`)."""
    if cpus is None:
        return
    threads, why = threads_per_rank(env, cpus, ranks_on_node, one_task_per_rank)
    if threads:
        out["OMP_NUM_THREADS"] = threads
    notes.append(f"threads per rank: {why}")


# srun-per-GPU mode: each worker variable and where Slurm has it.
SRUN_WORKER_ENV: dict[str, tuple[Source, ...]] = {
    "RANK": ("SLURM_PROCID",),
    "WORLD_SIZE": ("SLURM_NTASKS",),
    "LOCAL_RANK": ("SLURM_LOCALID",),
    "LOCAL_WORLD_SIZE": (*NPROC, slurm_tasks_per_node),
}


def srun_plan(env: Env, ctx: Context, argv: list[str], out: dict[str, str], master: tuple[str, int],
              node_rank: int | None, cpus: CPUs | None, notes: list[str]) -> NodePlan:
    """One task per process: srun started every worker; `out` gets the six worker variables."""
    for name, sources in SRUN_WORKER_ENV.items():
        out[name] = str(_int(_value(env, ctx, sources, name, notes), name))
    rank, world = int(out["RANK"]), int(out["WORLD_SIZE"])
    if not 0 <= rank < world:
        raise LaunchError(f"slurm-srun: SLURM_PROCID={rank} is not below SLURM_NTASKS={world}")
    set_threads(env, cpus, int(out["LOCAL_WORLD_SIZE"]), True, out, notes)
    out["MASTER_ADDR"], out["MASTER_PORT"] = master[0], str(master[1])
    return NodePlan(ctx.name, "srun", argv, out, node_rank=node_rank,
                    wait_for=master if node_rank != 0 else None, notes=notes)


def resolve_sizes(env: Env, ctx: Context, node_rank: int | None, cpus: CPUs | None,
                  out: dict[str, str], notes: list[str]) -> tuple[str, str]:
    """torchrun's --nnodes (N or MIN:MAX) and --nproc-per-node (a number), checked against the
    node rank; the workers' threads follow from the processes per node."""
    nnodes = _nnodes(_value(env, ctx, ctx.nnodes, "nnodes", notes))
    nproc = _value(env, ctx, ctx.nproc, "nproc per node", notes)
    if nproc == "auto" or not nproc.isdigit() or int(nproc) < 1:
        raise LaunchError(
            f"{ctx.name}: processes per node {nproc!r} must be a number (torchrun's 'auto' quietly "
            f"uses one process on some images); set {NPROC_PER_NODE_VAR}"
        )
    set_threads(env, cpus, int(nproc), False, out, notes)
    if cpus is not None and cpus.ids:  # the workers share them out (train.bind_cpus)
        out[NODE_CPUS_VAR] = format_cpus(cpus.ids)
    max_nodes = int(nnodes.split(":")[-1])
    if node_rank is not None and not 0 <= node_rank < max_nodes:
        raise LaunchError(f"{ctx.name}: node rank {node_rank} is not below nnodes {nnodes}")
    return nnodes, nproc


def resolve_stop_grace(env: Env, notes: list[str]) -> int:
    """torchrun's --shutdown-timeout: the target's grace period (`DDPKIT_STOP_GRACE_S`)."""
    sources = (STOP_GRACE_S_VAR, const(str(DEFAULT_STOP_GRACE_S)))
    grace = _int(_resolve(env, sources, "stop grace", notes) or "", STOP_GRACE_S_VAR)
    if grace < 1:
        raise LaunchError(f"{STOP_GRACE_S_VAR}={grace} must be at least 1 second")
    return grace


def store_host(env: Env, ctx: Context, node_rank: int | None) -> bool | None:
    """Whether this node hosts the rendezvous store; None: torch's own hostname match decides.

    Node 0 hosts it whatever its hostname resolves to (no guessing by name); where the rank is
    unknown and HOSTNAME too, torch decides."""
    if node_rank is not None:
        return node_rank == 0
    if ctx.name == "kubeflow-elastic" and env.get("HOSTNAME"):
        return False
    return None


#: An elastic rendezvous (`--nnodes MIN:MAX`) closes this long after MIN nodes have joined
#: (torch's default is 30 s). It is what a group that lost a node waits before it carries on
#: smaller: the survivors rejoin within seconds of each other, so a short wait loses nobody;
#: a node that comes later joins the running group through a restart (a membership change,
#: which the workers meet with a stop checkpoint and torchrun does not count as a failure).
ELASTIC_LAST_CALL_S = 5


def rdzv_conf(is_host: bool | None, timeout_s: int, nnodes: str = "1") -> str:
    """torchrun's --rdzv-conf: the join timeout, is_host where it is known, and for an elastic
    range the last-call wait (ELASTIC_LAST_CALL_S)."""
    conf = f"join_timeout={timeout_s}"
    low, _, high = nnodes.partition(":")
    if high and high != low:
        conf += f",last_call_timeout={ELASTIC_LAST_CALL_S}"
    return conf if is_host is None else f"is_host={'true' if is_host else 'false'},{conf}"


# -- doing it ---------------------------------------------------------------------------
def wait_for_master(host: str, port: int, timeout_s: float, log: Callable[[str], None] = print) -> float:
    """Seconds until `host:port` accepted a TCP connection; `LaunchError` after `timeout_s`.

    The error says which way it failed: the host never resolved (DNS), nothing listened on the
    port (connection refused), or no answer at all (unreachable, filtered)."""
    start = time.monotonic()
    deadline = start + timeout_s
    delay, last, announced = 0.2, "", False
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, remaining))):
                return time.monotonic() - start
        except socket.gaierror as e:
            last, why = f"{type(e).__name__}: {e}", f"host {host!r} does not resolve (DNS)"
        except ConnectionRefusedError as e:
            last, why = f"{type(e).__name__}: {e}", f"port {port} closed on {host} (nothing listens)"
        except OSError as e:  # unreachable, timed out
            last, why = f"{type(e).__name__}: {e}", "no answer"
        if remaining <= 0:
            raise LaunchError(
                f"master {host}:{port} not reachable after {timeout_s:.0f}s: {why} ({last}); check that "
                "node 0 started and the address and port are right (train.timeout_s sets the wait)"
            )
        if not announced:
            log(f"waiting for master {host}:{port} (up to {timeout_s:.0f}s)")
            announced = True
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 5.0)


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Linux: the child gets `signum` if the shim dies (even by SIGKILL); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_template(sock: str, env: dict[str, str], now: bool = False) -> subprocess.Popen:
    """The node's template process (trainer/warm.py): it binds `sock` at once, imports torch
    and the trainer (`now`: at once, else when the first worker is asked for), then forks a
    worker per client; it ends when its stdin closes, and with SIGKILL if the shim dies. Its
    own session: a terminal's Ctrl-C is not its business."""
    return subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", sock, *(["--now"] if now else [])],
                            env=env,
                            stdin=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: _die_with_parent(signal.SIGKILL))


def end_template(template: subprocess.Popen) -> None:
    """Close the template's stdin (it kills any worker left and exits); bounded wait."""
    with contextlib.suppress(OSError):
        template.stdin.close()
    try:
        template.wait(timeout=5)
    except subprocess.TimeoutExpired:
        template.kill()
        template.wait()


def supervise(argv: list[str], env: dict[str, str], log: Callable[[str], None] = print,
              record: attempts.LaunchRecord | None = None, warm: bool = False, warm_now: bool = False,
              store: tuple[str, int] | None = None) -> int:
    """Run torchrun as a child, forward stop signals, map a stopped run to a stop exit code.

    `EXIT_STOPPED` (143): a worker wrote `DDPKIT_STOP_FILE` after its stop checkpoint was
    complete on every rank (whichever way the stop request reached it); torchrun itself exits 1
    then. `EXIT_STOPPED_UNSAVED` (137): this shim got a stop signal and no checkpoint was written.
    With a `record`, torchrun's stderr passes through this process: the failed workers it
    reports and its last lines are written to the run directory (trainer/attempts.py).
    With `warm`, the node's template process (`start_template`) runs beside torchrun, its socket
    in the same private directory; `warm_now`: it imports at once (a one-node job: no other
    node's rendezvous to slow down). Inside a Slurm allocation whose batch shell started a
    resident template per node (`RESIDENT_VAR`), that one is used and forks torchrun's agent
    too: the child here is then `python -m trainer.warm --agent` (standard library only), which
    stands in for torchrun as a worker's client stands in for a worker (exit code or signal,
    stop signals forwarded; if it dies the template SIGKILLs torchrun): a new job step imports
    nothing. `store`: the rendezvous store on another node
    (`wait_for_torchrun` ends torchrun when that store stops answering).
    """
    import tempfile

    stop_dir = tempfile.mkdtemp(prefix="ddpkit-launch-")
    stop_file = os.path.join(stop_dir, "stopped")
    env = {**env, STOP_FILE_VAR: stop_file, TORCHRUN_T0_VAR: repr(time.time())}  # a launch mark
    # torchrun's own directory (the workers' error files) goes in ours, which goes at the end:
    # without --log-dir torchrun makes a /tmp/torchelastic_* per run and never removes it.
    # PET_LOG_DIR is torchrun's --log-dir default; a --log-dir in train.torchrun_args wins.
    env.setdefault("PET_LOG_DIR", os.path.join(stop_dir, "torchelastic"))
    template = None
    if warm:
        prefix = env.get(RESIDENT_VAR)
        sock = resident_template(resident_socket(prefix, env) if prefix else None, log)
        if sock is not None:  # the allocation's template forks torchrun too
            argv = [argv[0], "-m", "trainer.warm", "--agent", *argv[1:]]
        else:
            sock = os.path.join(stop_dir, "warm.sock")
            template = start_template(sock, env, now=warm_now)
            if record is not None:
                record.template_pid = template.pid
        env[WARM_SOCKET_VAR] = sock
    # Own session: a terminal's Ctrl-C reaches torchrun once (from us), not twice.
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                            stderr=subprocess.PIPE if record else None)
    relay = _relay_stderr(proc, record) if record else None
    stopped: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if signum != signal.SIGHUP:
            stopped.append(signum)
        proc.send_signal(signum)

    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), forward)
    forked = warm and template is None  # torchrun's agent is the resident template's child
    rc = wait_for_torchrun(proc, store, log, agent=(lambda: forked_agent(stop_file) or proc.pid) if forked else None)
    if template is not None:
        end_template(template)
        with contextlib.suppress(OSError):
            os.unlink(env[WARM_SOCKET_VAR])
    if relay is not None:
        relay.join(timeout=5)
    try:
        saved = open(stop_file).read().strip() or "?"
    except OSError:
        saved = None
    shutil.rmtree(stop_dir, ignore_errors=True)
    code = _exit_code(rc, saved, stopped, log)
    if record is not None:
        record.write(rc, code)
        if record.oom_kills:
            log(f"{attempts.OOM_LINE} {record.oom_kills} process(es) in this node's memory cgroup while "
                "torchrun ran: a worker's SIGKILL (-9) is out of memory")
    return code


#: torchrun without a worker for this long, not exiting: is its rendezvous store still there?
IDLE_BEFORE_PROBE_S = 5.0
#: The store must answer a request within this (connecting included).
STORE_PROBE_S = 10.0


def forked_agent(stop_file: str) -> int | None:
    """The pid of torchrun's agent when a template forked it (trainer/warm.py `AGENT_NAME`):
    the process of that name whose environment has this launcher's own stop file."""
    from trainer.warm import AGENT_NAME

    mine = f"{STOP_FILE_VAR}={stop_file}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if (Path(f"/proc/{pid}/comm").read_text().strip() == AGENT_NAME
                    and mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                return int(pid)
    return None


#: How long a launcher waits for its allocation's resident template (started beside the first
#: job step) to listen before it starts a template of its own.
RESIDENT_WAIT_S = 10.0


def resident_template(path: str | None, log: Callable[[str], None]) -> str | None:
    """The socket of the allocation's resident template (`RESIDENT_VAR`, trainer/warm.py) when
    it listens on this node in a directory of this user's alone; None: start our own."""
    if not path:
        return None
    from trainer.warm import private_dir_problem

    deadline = time.monotonic() + RESIDENT_WAIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    why = private_dir_problem(os.path.dirname(path)) if os.path.exists(path) else f"no socket at {path}"
    if not why:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError as e:  # refused: the template is gone (a socket file left behind)
                why = f"{path}: {e.strerror}"
    if why:
        log(f"warm restarts: the allocation's template is not usable ({why}): this node starts its own")
        return None
    log(f"warm restarts: torchrun and the workers are forked from the allocation's template ({path})")
    return path


def wait_for_torchrun(proc: subprocess.Popen, store: tuple[str, int] | None, log: Callable[[str], None],
                      agent: Callable[[], int] | None = None) -> int:
    """torchrun's exit code; with `store` (the rendezvous store on another node), also watch
    for a torchrun that can never exit: torch's TCPStore client (2.13) logs its timeout, then
    retries an unanswered request without end, so once the store's host is gone without a
    reset (a node that died with its link, or froze) torchrun hangs in its rendezvous or
    shutdown after its workers ended (their watchdog ends them: trainer/watchdog.py). When
    torchrun has had no worker for `IDLE_BEFORE_PROBE_S` and the store does not answer within
    `STORE_PROBE_S`, torchrun is ended and the node exits 1, as torchrun does after a failed
    worker; the target restarts the node where restarts are left. A refused or reset
    connection (the store's process ended: a finished run) is torchrun's own to handle.
    `agent`: torchrun's pid when `proc` only stands in for it (forked by the template)."""
    if store is None:
        return proc.wait()
    idle_since: float | None = None
    while True:
        try:
            return proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        if _children(agent() if agent else proc.pid):
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if time.monotonic() - idle_since < IDLE_BEFORE_PROBE_S:
            continue
        if store_answers(*store, STORE_PROBE_S) or proc.poll() is not None:
            idle_since = time.monotonic()
            continue
        log(f"torchrun has had no worker for {time.monotonic() - idle_since:.0f}s and its rendezvous store "
            f"{_endpoint(*store)} does not answer within {STORE_PROBE_S:.0f}s: node rank 0, its host, is "
            f"gone, frozen or cut off, and torchrun would wait for it for good; ending torchrun: exit {EXIT_FAILURE}")
        _end(proc)
        return EXIT_FAILURE


def _children(pid: int) -> list[int]:
    """The live children of `pid` (a worker that exited but was not reaped is a zombie: gone)."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            state, ppid = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            if ppid == str(pid) and state != "Z":
                found.append(int(p))
    return found


def store_answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether the c10d store at host:port answers a request (or its host refuses the
    connection: the store's process ended, its host did not) within `timeout_s`. A daemon
    thread asks: the call itself may never return."""
    import datetime

    started = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # no route, no answer in time, a name that no longer resolves
        return False

    try:
        import torch.distributed as dist  # only here: a launcher that never probes never imports torch
    except ImportError:
        return True  # no way to ask: torchrun's own business
    outcome = threading.Event()
    left = max(1.0, timeout_s - (time.monotonic() - started))

    def ask() -> None:
        try:
            dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=left),
                          wait_for_workers=False).check(["ddpkit/probe"])
        except Exception:  # noqa: BLE001  (reset: an answer of sorts; torch's own timeout: none)
            if time.monotonic() - started >= timeout_s:
                return
        outcome.set()

    threading.Thread(target=ask, name="ddpkit-store-probe", daemon=True).start()
    return outcome.wait(left)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun's process group, SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _exit_code(rc: int, saved: str | None, stopped: list[int], log: Callable[[str], None]) -> int:
    if rc == 0:
        return 0
    if saved is not None:
        log(f"stopped after the checkpoint of step {saved}: exit {EXIT_STOPPED}")
        return EXIT_STOPPED
    if stopped:
        log(f"stopped by {signal.Signals(stopped[0]).name} before a checkpoint was written "
            f"(torchrun exit {rc}): exit {EXIT_STOPPED_UNSAVED}; a restart resumes from the previous one")
        return EXIT_STOPPED_UNSAVED
    return 128 - rc if rc < 0 else rc  # torchrun killed by a signal: the shell's 128+N


def _relay_stderr(proc: subprocess.Popen, record: attempts.LaunchRecord) -> threading.Thread:
    """A thread that copies torchrun's stderr to ours as it comes and feeds `record`."""
    def relay() -> None:
        out = sys.stderr.buffer
        for raw in proc.stderr:
            with contextlib.suppress(OSError, ValueError):
                out.write(raw)
                out.flush()
            record.feed(raw.decode("utf-8", errors="replace"))

    thread = threading.Thread(target=relay, name="ddpkit-stderr", daemon=True)
    thread.start()
    return thread


# -- tagging the node's lines (Slurm: every node writes the job's one file) -------------------
#: Contexts whose nodes share one output file: their lines carry contract.NODE_LINE_TAG
#: (any context does with DDPKIT_LINE_TAGS=1: `ddpkit run --local` keeps RUN_DIR/output.log).
TAGGED_CONTEXTS = ("slurm", "slurm-srun")
#: How long the launcher waits, after its child ended, for the relay to write the last lines.
RELAY_DRAIN_S = 10.0


def tag_lines(data: bytes, node: int, rank: int | None) -> bytes:
    """`data` (whole lines) with each line started by its tag (contract.node_line_tag): `rank`
    where the launcher knows it (srun mode), else the rank the line names, else `-`."""
    out = []
    for line in data.splitlines(keepends=True):
        named = rank if rank is not None else contract.line_worker_rank(line.decode("utf-8", "replace"))
        out.append(contract.node_line_tag(node, named).encode() + line)
    return b"".join(out)


def relay(read_fd: int, write_fd: int, node: int, rank: int | None) -> None:
    """Copy whole lines from `read_fd` to `write_fd`, each tagged, until end of file.

    A line is written only once its newline came (or the stream ended): a long line that the
    writer wrote in pieces comes out as one line, with one tag."""
    pending = b""
    while True:
        try:
            data = os.read(read_fd, 65536)
        except InterruptedError:
            continue
        if not data:
            break
        pending += data
        cut = pending.rfind(b"\n") + 1
        if cut:
            _write_all(write_fd, tag_lines(pending[:cut], node, rank))
            pending = pending[cut:]
    if pending:
        _write_all(write_fd, tag_lines(pending + b"\n", node, rank))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:  # the reader is gone (the step's I/O closed): nothing more to do
            return


def start_relay(node: int, rank: int | None) -> int:
    """Route this process's stdout and stderr, and so those of every process it starts,
    through a relay process that tags each whole line (`relay`); the relay's pid.

    The relay ignores the stop signals (Slurm signals every process of a step) and ends when
    the last writer closed the streams, so the workers' last lines after a stop still come."""
    import threading

    sys.stdout.flush()
    sys.stderr.flush()
    pipes = {fd: os.pipe() for fd in (1, 2)}
    pid = os.fork()
    if pid == 0:  # the relay
        try:
            for name in (*FORWARDED_SIGNALS, "SIGQUIT"):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
            for _, write_end in pipes.values():
                os.close(write_end)
            threads = [threading.Thread(target=relay, args=(read_end, fd, node, rank), daemon=True)
                       for fd, (read_end, _) in pipes.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            os._exit(0)
    for fd, (read_end, write_end) in pipes.items():
        os.close(read_end)
        os.dup2(write_end, fd)
        os.close(write_end)
    return pid


def end_relay(pid: int, timeout_s: float = RELAY_DRAIN_S) -> None:
    """Close this process's ends of the relay's streams and give it `timeout_s` to write the
    rest (a worker's orphan that still holds a stream would keep it open for ever)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        time.sleep(0.05)


@dataclass
class JobSettings:
    """What the launcher takes from the job file (`DDPKIT_JOB_FILE`; all defaults without one)."""

    run_id: str | None = None
    timeout_s: int = 600
    entry: list[str] | None = None  # None: the trainer
    script: str | None = None
    preflight: bool = False
    torchrun_args: list[str] = field(default_factory=list)
    cpus_per_node: float | None = None
    threads: int | None = None
    output_dir: str | None = None  # the trainer's `train.output_dir`: the run directory's parent
    warm_restarts: bool = True  # `train.warm_restarts` (applies to the built-in trainer)
    gpus_per_node: int | None = None  # None: no job file (nothing is checked or hidden)


def read_job_settings(env: Env) -> JobSettings:
    """The job file's settings, with the preflight entry applied; LaunchError on a bad file."""
    job = JobSettings()
    if env.get(JOB_FILE_VAR):
        from pydantic import ValidationError

        from trainer.config import error_line, load_job_sections

        try:
            sections = load_job_sections(env[JOB_FILE_VAR])
        except (OSError, ValueError, ValidationError) as e:
            raise LaunchError(f"bad job file {env[JOB_FILE_VAR]}: {error_line(e)}") from None
        job = JobSettings(sections.name, sections.train.timeout_s, sections.entry, sections.script,
                          sections.preflight, sections.torchrun_args, sections.cpus_per_node,
                          sections.train.threads, sections.train.output_dir, sections.train.warm_restarts,
                          sections.gpus_per_node)
    if job.entry not in (None, TRAINER):  # your own script: under trainer.guard (stacks, exceptions)
        job.entry = [*GUARD, *job.entry]
    if env.get(PREFLIGHT_ONLY_VAR) == "1":  # `python -m trainer.preflight` on a node
        job.entry, job.script, job.preflight = list(PREFLIGHT), None, False
    elif job.preflight:  # `preflight: true`: each worker checks, then runs the real entry
        job.entry = [*PREFLIGHT, "--then", *(job.entry or TRAINER)]
    return job


def warm_start(env: Env, job: JobSettings) -> bool:
    """Whether torchrun's workers are forked from a template (trainer/warm.py): `DDPKIT_WARM`
    ("0" or "1") where the node sets it, else `train.warm_restarts` for ddpkit's own entries
    (the trainer, preflight); a `script` or `module` job starts cold (its imports and its
    fork-safety are its own). LaunchError on another value."""
    value = env.get(WARM_VAR, "")
    if value not in ("", "0", "1"):
        raise LaunchError(f"{WARM_VAR}={value!r} must be 0 (cold restarts) or 1 (warm restarts)")
    if value:
        return value == "1"
    entry = job.entry or TRAINER
    return job.warm_restarts and entry[:2] in (TRAINER, PREFLIGHT)


def node_cpus(job: JobSettings) -> CPUs:
    try:
        ids = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        ids = ()
    affinity = len(ids) or os.cpu_count() or 1
    return CPUs(affinity, cgroup_cpus(), job.cpus_per_node, job.threads, ids)


def main() -> int:
    env = dict(os.environ)
    env.setdefault(LAUNCH_T0_VAR, repr(time.time()))

    def log(msg: str) -> None:
        print(f"ddpkit launch: {msg}", file=sys.stderr, flush=True)

    try:
        job = read_job_settings(env)
    except LaunchError as e:
        log(str(e))
        return EXIT_BAD_CONFIG
    if job.script is not None and not os.path.isfile(job.script):
        return refuse(job, log, f"script {job.script}: no such file in {os.getcwd()}; the image, a "
                      "volume or the working directory must hold it on every node (a relative path "
                      "is relative to the working directory)")
    if job.gpus_per_node and (missing := gpus.missing_gpus(job.gpus_per_node, gpus.gather(env))):
        return refuse(job, log, missing)
    try:
        plan = plan_launch(env, run_id=job.run_id, timeout_s=job.timeout_s, entry=job.entry,
                           torchrun_args=job.torchrun_args, cpus=node_cpus(job), warm=warm_start(env, job))
    except LaunchError as e:
        return refuse(job, log, str(e))
    run_dir = run_dir_of(job)
    if job.gpus_per_node == 0:
        gpus.hide_from_cpu_job(plan.env)
    elif job.gpus_per_node:
        gpus.flight_recorder(plan.env, run_dir)
    if job.entry and job.entry[:2] == GUARD and run_dir is not None:
        plan.env[RUN_DIR_VAR] = str(run_dir.resolve())
    relay_pid = None
    tagged = plan.context in TAGGED_CONTEXTS or env.get(contract.LINE_TAGS_VAR) == "1"
    if tagged and plan.node_rank is not None and plan.mode != "direct":
        worker = int(plan.env["RANK"]) if plan.mode == "srun" else None
        relay_pid = start_relay(plan.node_rank, worker)
    for note in plan.notes:
        log(note)
    try:
        return start(plan, job, log)
    finally:  # not reached after an exec (srun mode): the relay ends with the trainer's streams
        if relay_pid is not None:
            end_relay(relay_pid)


def run_dir_of(job: JobSettings) -> Path | None:
    """The trainer's run directory (trainer/attempts.py), where the job file names one."""
    return attempts.run_directory(job.output_dir, job.run_id) if job.output_dir and job.run_id else None


def refuse(job: JobSettings, log: Callable[[str], None], why: str, code: int = EXIT_BAD_CONFIG,
           node_rank: int = 0) -> int:
    """The launcher ends before torchrun ran: says why, and leaves it for `ddpkit why`."""
    log(why)
    attempts.LaunchRecord(run_dir_of(job), node_rank, 1).write(None, code, refused=why)
    return code


def start(plan: NodePlan, job: JobSettings, log: Callable[[str], None]) -> int:
    """Wait for the master where the plan says so, then run torchrun (supervised) or exec."""
    # Until torchrun or the trainer owns the signals: a stop while waiting is a retryable exit
    # with nothing saved (and a Python PID 1 would otherwise ignore SIGTERM).
    for name in ("SIGTERM", "SIGUSR2"):
        signal.signal(getattr(signal, name), lambda signum, frame: sys.exit(EXIT_STOPPED_UNSAVED))
    log(f"context {plan.context}, node rank {plan.node_rank}, mode {plan.mode}: {' '.join(plan.argv[1:])}")
    if plan.wait_for:
        try:
            took = wait_for_master(*plan.wait_for, timeout_s=job.timeout_s, log=log)
        except LaunchError as e:
            return refuse(job, log, str(e), EXIT_FAILURE, plan.node_rank or 0)
        if job.preflight or job.entry == PREFLIGHT:
            log(f"preflight: master {_endpoint(*plan.wait_for)} resolved and accepted a TCP connection after {took:.2f}s")
    if plan.mode == "torchrun":
        nproc = int(plan.env.get(NPROC_PER_NODE_VAR) or 1)
        one_node = plan.argv[plan.argv.index("--nnodes") + 1] == "1"
        code = supervise(plan.argv, plan.env, log, attempts.LaunchRecord(run_dir_of(job), plan.node_rank or 0, nproc),
                         warm=plan.warm, warm_now=plan.warm and one_node, store=plan.wait_for)
        if code != 0 and RUN_DIR_VAR in plan.env and not plan.node_rank:
            script_verdict(plan, Path(plan.env[RUN_DIR_VAR]), nproc, code)
        return code
    sys.stdout.flush()
    os.execve(plan.argv[0], plan.argv, plan.env)
    return EXIT_FAILURE  # not reached


def script_verdict(plan: NodePlan, run_dir: Path, nproc: int, code: int) -> None:
    """Node 0's launcher of a script job that failed or was stopped: trainer.guard's verdict
    from every rank's stacks (the other nodes' reach a shared run directory a little later)."""
    from trainer import guard

    nnodes = plan.argv[plan.argv.index("--nnodes") + 1].split(":")[-1]
    world = int(nnodes) * nproc
    deadline = time.monotonic() + (5.0 if int(nnodes) > 1 else 1.0)
    while time.monotonic() < deadline and not all(
            any((d / f"rank-{r}.txt").exists() for d in (run_dir / "debug").glob("attempt-*")) for r in range(world)):
        time.sleep(0.2)
    guard.write_verdict(run_dir, world, stopped="a stop signal" if code == EXIT_STOPPED_UNSAVED else None)


if __name__ == "__main__":
    sys.exit(main())
