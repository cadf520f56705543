"""The `#SBATCH` options of a job, as data: `of(job)` -> ((name, value), ...) in script order.

One topology, every count derived: torchrun mode runs one Slurm task per node (torchrun starts
the workers, the task gets all the node's CPUs); srun mode one task per process. A value is a
string or a number, or True for a flag (`--exclusive`), as submitit's parameters are; `flag`
is the one formatter (`--name=value` / `--name`), like submitit's `_as_sbatch_flag`.
"""

from __future__ import annotations

import math
import posixpath
import re

from deploy.spec import JobSpec
from deploy.units import slurm_time

Value = str | int | bool
Directive = tuple[str, Value]

# sbatch reads #SBATCH lines itself (no shell); keep values to characters it passes unchanged.
VALUE = re.compile(r"^[A-Za-z0-9_.,:@%+=/|&~*()\[\]-]+$")

#: CPUs per GPU when a GPU job does not say (resources.cpus_per_node): Slurm's default of one
#: CPU per task would run a node's eight torchrun workers and their data loading on one core.
CPUS_PER_GPU = 4


def flag(name: str, value: Value) -> str:
    """`--name=value`, or `--name` for a flag (value True)."""
    return f"--{name}" if value is True else f"--{name}={value}"


def parse(directive: str) -> Directive:
    """`--name=value` -> (name, value); `--flag` -> (flag, True). The spec checked the form."""
    name, sep, value = directive.removeprefix("--").partition("=")
    return name, value if sep else True


def tasks_per_node(job: JobSpec) -> int:
    """Slurm tasks on each node: 1 (torchrun starts the workers) or one per process."""
    return 1 if job.slurm.launcher == "torchrun" else job.nproc_per_node


def cpus_per_task(job: JobSpec) -> int | None:
    """`--cpus-per-task`: the node's CPUs split over its tasks (render.check refuses a split
    that would give less than was asked). Unset: CPUS_PER_GPU per GPU, one per process on CPU
    (None where that is Slurm's own default of 1)."""
    cpus = job.resources.cpus_per_node
    tasks = tasks_per_node(job)
    if cpus is None:
        per_task = job.nproc_per_node // tasks * (CPUS_PER_GPU if job.gpus_per_node else 1)
        return per_task if job.gpus_per_node or per_task > 1 else None
    return max(1, math.ceil(cpus) // tasks)


def gpu_request(job: JobSpec) -> Directive | None:
    """The GPU option: `gres`/`gpu:[TYPE:]N` or `gpus-per-node`/`[TYPE:]N` (slurm.gpu_flag,
    slurm.gpu_type)."""
    if not job.gpus_per_node:
        return None
    typed = f"{job.slurm.gpu_type}:" if job.slurm.gpu_type else ""
    if job.slurm.gpu_flag == "gres":
        return "gres", f"gpu:{typed}{job.gpus_per_node}"
    return "gpus-per-node", f"{typed}{job.gpus_per_node}" if typed else job.gpus_per_node


def gres_option(job: JobSpec) -> str | None:
    """`--gres`: the GPUs when slurm.gpu_flag is gres, then the `--gres=` of
    slurm.extra_directives, as one list (sbatch keeps only the last --gres it is given)."""
    gpus = gpu_request(job)
    items = [str(gpus[1])] if gpus and gpus[0] == "gres" else []
    items += [str(value) for name, value in map(parse, job.slurm.extra_directives) if name == "gres"]
    return ",".join(items) or None


def memory_option(job: JobSpec) -> str | None:
    """`--mem`: `0` (all of the node's) with slurm.all_memory, else resources.memory in MiB
    rounded up; None leaves Slurm's default."""
    if job.slurm.all_memory:
        return "0"
    memory = job.resources.memory_bytes
    return None if memory is None else f"{-(-memory // 2**20)}M"


def signal_option(job: JobSpec) -> str | None:
    """`--signal=B:SIG@SECONDS`: before the time limit the batch shell is signalled and tells
    the trainer to checkpoint and stop (then requeues with slurm.requeue). Every job with a
    time limit gets it, not only requeued ones: a job that hits its limit keeps its work."""
    s = job.slurm
    if job.time_limit is None and not s.requeue:
        return None
    return f"B:{s.signal}@{s.signal_seconds}"


def log_file(job: JobSpec) -> str:
    """`--output` and `--error`: one file per job in slurm.log_dir."""
    return posixpath.join(job.slurm.log_dir, "%x-%j.out")


def restarts_in_allocation(job: JobSpec) -> bool:
    """Whether a failed job step is started again by the batch shell, inside the allocation,
    without the nodes that stopped answering (slurm/job.sh.j2, which then asks for `--no-kill`):
    for a job with `restarts` and somewhere to go, spare nodes or an elastic range to shrink
    within. ddpkit's sbatch script only: `--via submitit` writes its own script (an elastic
    job there is requeued by Slurm; spare nodes are refused)."""
    return bool(job.restarts) and (job.slurm.spare_nodes > 0 or job.nodes.elastic)


def resident_template(job: JobSpec) -> bool:
    """Whether the batch shell starts a template per node that outlives the job steps
    (trainer/warm.py `serve(resident=True)`), so that a step started again inside the allocation
    forks torchrun and the workers instead of importing torch: restarts inside the allocation,
    torchrun mode, the built-in trainer with `train.warm_restarts` (what the launcher forks).
    Not under pyxis: two steps starting the job's named container at once was not tried (each
    step's launcher then starts its own template, as before)."""
    return (restarts_in_allocation(job) and job.slurm.launcher == "torchrun" and job.train.warm_restarts
            and not (job.script or job.module or job.command) and job.slurm.container != "pyxis")


def of(job: JobSpec) -> tuple[Directive, ...]:
    """The `#SBATCH` options, all derived from the JobSpec, in the order the script prints them."""
    s = job.slurm
    spare = s.spare_nodes
    nodes = job.nodes.min + spare if not job.nodes.elastic else f"{job.nodes.min + spare}-{job.nodes.max + spare}"
    gpus = gpu_request(job)
    per_node = gpus[1] if gpus and gpus[0] == "gpus-per-node" else None
    # (name, value or None for "not asked for", the field a wrong value would come from)
    out: list[tuple[str, Value | None, str]] = [
        ("job-name", job.name, "name"),
        ("nodes", nodes, "nodes"),
        ("ntasks-per-node", tasks_per_node(job), "slurm.launcher"),
        ("cpus-per-task", cpus_per_task(job), "resources.cpus_per_node"),
        ("gpus-per-node", per_node, "gpus_per_node"),
        ("gres", gres_option(job), "slurm.extra_directives"),
        ("mem", memory_option(job), "resources.memory"),
        ("time", None if job.time_limit is None else slurm_time(job.time_limit), "time_limit"),
        *((key, getattr(s, key), f"slurm.{key}") for key in ("partition", "account", "qos", "constraint")),
        ("exclusive", s.exclusive or None, "slurm.exclusive"),
        ("output", log_file(job), "slurm.log_dir"),
        ("error", log_file(job), "slurm.log_dir"),
        ("open-mode", "append", ""),
        # Slurm requeues a job whose node failed when the job is requeueable (its JobRequeue=1
        # default): so `restarts` says it explicitly, both ways; the script bounds the count.
        ("requeue" if job.restarts else "no-requeue", True, "restarts"),
        ("signal", signal_option(job), "slurm.signal"),
    ]
    derived = tuple((name, _checked(value, field)) for name, value, field in out if value is not None)
    return derived + tuple(d for d in map(parse, s.extra_directives) if d[0] != "gres")


def _checked(value: Value, field: str) -> Value:
    if value is not True and not VALUE.match(str(value)):  # render.check refuses every user value that could
        raise RuntimeError(f"{field}: {str(value)!r} reached an #SBATCH line unchecked")
    return value
