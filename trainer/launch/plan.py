"""The launch plan: what a node sees in, one torchrun invocation (or, in Slurm srun-per-GPU
mode, the six per-worker variables `trainer.dist` reads) out. Pure: no process is started, no
file is read; `plan_launch` is tested context by context.

Which variable carries which fact in which context is a table (`CONTEXTS`), not a maze of ifs.
Precedence, per field: the first source in the table's tuple that is set wins. `DDPKIT_*`
values come first because they are rendered from the job file (the one source of topology,
docs/CONTRACT.md); a scheduler variable that disagrees is reported and ignored. Stale worker
variables that an image or a controller pre-set (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...,
`PET_*`) are removed before torchrun starts, and reported, so torchrun sees exactly the flags
we log.

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

With `warm` (trainer/launch/supervise.py has the template's side), torchrun runs
`python -m trainer.warm ENTRY`, a client that has the node's template process fork the worker.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from trainer import contract
from trainer.config import TRAINER_ENTRY
from trainer.contract import (
    CONTEXT_VAR,
    DEFAULT_PORT,
    DEFAULT_STOP_GRACE_S,
    LAUNCHER_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
    MAX_RESTARTS_VAR,
    NNODES_VAR,
    NODE_CPUS_VAR,
    NPROC_PER_NODE_VAR,
    RUN_ID_VAR,
    STOP_GRACE_S_VAR,
    TORCHRUN_SIGNALS,
    WARM_VAR,
    format_cpus,
)

Env = Mapping[str, str]
Source = str | Callable[[Env], "str | None"]

TRAINER = list(TRAINER_ENTRY)
PREFLIGHT = ["-m", "trainer.preflight"]
GUARD = ["-m", "trainer.guard"]  # a script job's workers: stacks on a stop, its exceptions recorded
WARM_CLIENT = ["-m", "trainer.warm"]  # the worker torchrun starts on the warm path (trainer/warm.py)
FRESH_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
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
    ids: tuple[int, ...] = ()  # the CPUs of the affinity, when known (trainer/host.py splits them)


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


def endpoint(addr: str, port: int) -> str:
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
        "--rdzv-endpoint", endpoint(addr, port),
        "--rdzv-id", run_id,
        "--rdzv-conf", rdzv_conf(is_host, timeout_s, nnodes),
        "--max-restarts", str(restarts),
        "--signals-to-handle", ",".join(TORCHRUN_SIGNALS),
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


