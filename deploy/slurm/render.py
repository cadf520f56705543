"""The sbatch script for a job: `render_slurm(job) -> str` (template `slurm/job.sh.j2`).

Every count comes from the JobSpec's one topology (nodes, processes per node, GPUs, CPUs):
- torchrun mode: one Slurm task per node, running `python -m trainer.launch`, which starts
  torchrun with `nproc_per_node` workers; the task gets all the node's CPUs.
- srun mode: one Slurm task per process (per GPU), each running `trainer.launch`, which maps
  SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS onto RANK/LOCAL_RANK/WORLD_SIZE; no torchrun.

Choices worth knowing:
- The script embeds the validated job YAML and writes it next to the logs at run time, so the
  script alone is the whole job (no path back to the submit host's job file).
- `srun` is given `--cpus-per-task` explicitly: Slurm 22.05 stopped passing the batch's value on
  to steps, and a torchrun task pinned to one CPU runs all its workers on it.
- The requeue path (trap, forward, wait, `scontrol requeue`) lives in the batch shell, outside
  any container, bounded by `restarts` through SLURM_RESTART_COUNT.
- A lost node (slurmd silent for SlurmdTimeout: node DOWN, job NODE_FAIL) requeues the job only
  when it is requeueable: `--requeue` with `restarts` >= 1, `--no-requeue` with 0 (Slurm's
  JobRequeue=1 default would requeue it). The script refuses to start restart N+1 of a job
  with `restarts: N` (Slurm counts every requeue in SLURM_RESTART_COUNT).
- The run id is the job name, so a resubmitted job finds its checkpoints and its FINISHED marker.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import re
import sys
from pathlib import Path

from deploy import __version__, durability, image_forms, units
from deploy.problems import Problem, refuse
from deploy.slurm.template import render_template, shquote
from deploy.spec import JobSpec
from deploy.units import slurm_time

DEFAULT_COMMAND = ["python", "-m", "trainer.launch"]
HEREDOC_END = "DDPKIT_JOB_YAML"
# sbatch reads #SBATCH lines itself (no shell); keep values to characters it passes unchanged.
_DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9_.,:@%+=/|&~-]+$")


def render_slurm(job: JobSpec, *, source: str = "job.yaml") -> str:
    """The sbatch script for `job`; `source` is the job file's name, shown in the header."""
    refuse(job, check(job))
    return render_template("slurm", "job.sh.j2", **slurm_context(job, source=source))


def render(job: JobSpec, *, flavor: None = None, source: str = "job.yaml") -> str:
    """The target's render verb (deploy/targets.py): `render_slurm` (Slurm has no flavors)."""
    return render_slurm(job, source=source)


def after_render(job: JobSpec) -> None:
    """sbatch opens `--output` before the script runs and fails the job, silently, when its
    directory is missing: so `ddpkit render slurm job.yaml -o job.sbatch && sbatch job.sbatch`
    works as written, the log directory (relative: to here, where sbatch runs) is created now."""
    path = Path(job.slurm.log_dir)
    if path.is_dir():
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        print(f"created {job.slurm.log_dir}/ for the job's log (sbatch needs it before the job starts)",
              file=sys.stderr)
    except OSError as exc:
        print(f"note: could not create {job.slurm.log_dir}/ ({exc.strerror}): create it before sbatch, "
              "which fails a job whose log directory is missing", file=sys.stderr)


def check(job: JobSpec, flavor: None = None) -> list[Problem]:
    """Everything an sbatch script (or submitit) cannot do with `job` (deploy/problems.py:
    `ddpkit validate` reports the same lines as `render slurm` and `submit slurm`)."""
    problems = []
    s = job.slurm
    if s.container != "none":
        problems += image_forms.problems(job.image, s.container)
    problems += durability.slurm_problems(job)
    if s.launcher == "srun" and job.restarts and not s.requeue:
        problems.append(Problem(
            "restarts", f"{job.restarts} in srun mode, but with slurm.requeue off only a lost node "
            "would requeue the job; a crashed rank ends it (srun mode has no torchrun to restart workers)",
            "set slurm.requeue: true (requeue before the time limit), use slurm.launcher: "
            "torchrun, or set restarts: 0"))
    cpus = job.resources.cpus_per_node
    tasks = tasks_per_node(job)
    if cpus is not None and (math.ceil(cpus) % tasks or math.ceil(cpus) < tasks):
        low, high = (math.ceil(cpus) // tasks) * tasks, (math.ceil(cpus) // tasks + 1) * tasks
        problems.append(Problem(
            "resources.cpus_per_node", f"{cpus:g} CPUs over {tasks} Slurm tasks per node (srun "
            "mode: one per process) is not a whole number per task, and Slurm gives each task "
            "whole CPUs: ddpkit would ask for fewer than you wrote",
            f"use a multiple of {tasks} ({' or '.join(str(n) for n in (low, high) if n)})"))
    if job.time_limit is not None and job.time_limit <= s.signal_seconds:
        problems.append(Problem(
            "time_limit", f"{units.format_duration(job.time_limit)} must exceed "
            f"slurm.signal_seconds ({s.signal_seconds}s), the warning before the limit",
            "raise time_limit or lower slurm.signal_seconds"))
    if not _DIRECTIVE_VALUE.match(s.log_dir):
        problems.append(Problem("slurm.log_dir", f"{s.log_dir!r} cannot go into an #SBATCH line",
                                "use letters, digits and _.,:@%+=/|&~- only (no spaces or quotes)"))
    if any(line == HEREDOC_END for line in job.to_yaml().splitlines()):
        problems.append(Problem("(top level)", f"the job contains a line {HEREDOC_END!r}, which "
                                "ends the embedded job file", "change that value"))
    return problems


def tasks_per_node(job: JobSpec) -> int:
    """Slurm tasks on each node: 1 (torchrun starts the workers) or one per process."""
    return 1 if job.slurm.launcher == "torchrun" else job.nproc_per_node


#: CPUs per GPU when a GPU job does not say (resources.cpus_per_node): Slurm's default of one
#: CPU per task would run a node's eight torchrun workers and their data loading on one core.
CPUS_PER_GPU = 4


def cpus_per_task(job: JobSpec) -> int | None:
    """`--cpus-per-task`: the node's CPUs split over its tasks (check() refuses a split that
    would give less than was asked). Unset: CPUS_PER_GPU per GPU, one per process on CPU
    (None where that is Slurm's own default of 1)."""
    cpus = job.resources.cpus_per_node
    tasks = tasks_per_node(job)
    if cpus is None:
        per_task = job.nproc_per_node // tasks * (CPUS_PER_GPU if job.gpus_per_node else 1)
        return per_task if job.gpus_per_node or per_task > 1 else None
    return max(1, math.ceil(cpus) // tasks)


def gpu_request(job: JobSpec) -> tuple[str, object] | None:
    """The GPU option as (key, value): `gres`/`gpu:[TYPE:]N` or `gpus-per-node`/`[TYPE:]N`
    (slurm.gpu_flag, slurm.gpu_type)."""
    if not job.gpus_per_node:
        return None
    typed = f"{job.slurm.gpu_type}:" if job.slurm.gpu_type else ""
    if job.slurm.gpu_flag == "gres":
        return "gres", f"gpu:{typed}{job.gpus_per_node}"
    return "gpus-per-node", f"{typed}{job.gpus_per_node}" if typed else job.gpus_per_node


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


def gpu_vendor_flag(job: JobSpec) -> str | None:
    """Apptainer's GPU option: `--nv` for NVIDIA, `--rocm` for AMD (by gpu_resource)."""
    if not job.gpus_per_node:
        return None
    return {"nvidia.com/gpu": "--nv", "amd.com/gpu": "--rocm"}.get(job.gpu_resource)


def container_name(job: JobSpec) -> str:
    """pyxis `--container-name`: stable for the job and its image, so a requeued job (same
    name, same image) reuses the imported container instead of importing it on every node."""
    digest = hashlib.sha256(job.image.encode()).hexdigest()[:8]
    return f"ddpkit-{job.name}-{digest}"


def finished_marker(job: JobSpec) -> str | None:
    """Where the batch shell finds `FINISHED`, or None when it cannot see that path.

    The trainer resolves a relative checkpoint dir against `<train.output_dir>/<run id>` in its
    working directory (the submit directory, also inside containers, which mount it there). An
    absolute path inside a container is mapped back through the container mounts; one that no
    mount covers lives only in the container, and the trainer's own check is the only one.
    """
    path = job.checkpoint.dir
    if not posixpath.isabs(path):
        path = posixpath.join(job.train.output_dir, job.name, path)
    elif job.slurm.container != "none":
        for src, dst in sorted(_mount_pairs(job), key=lambda p: -len(p[1])):
            if path == dst or path.startswith(dst.rstrip("/") + "/"):
                path = src.rstrip("/") + path[len(dst.rstrip("/")):]
                break
        else:
            return None
    return posixpath.normpath(posixpath.join(path, "FINISHED"))


def _mount_pairs(job: JobSpec) -> list[tuple[str, str]]:
    return [(m.split(":")[0], m.split(":")[1]) for m in container_mounts(job)]


def container_mounts(job: JobSpec) -> list[str]:
    """Container bind mounts `SRC:DST[:ro]`: slurm.container_mounts plus host_path volumes."""
    mounts = list(job.slurm.container_mounts)
    for volume in job.volumes:
        if volume.host_path is not None:
            mounts.append(f"{volume.host_path}:{volume.mount}" + (":ro" if volume.read_only else ""))
    return mounts


def _directive(key: str, value: object = None, *, field: str) -> str:
    if value is None:
        return f"--{key}"
    text = str(value)
    if not _DIRECTIVE_VALUE.match(text):  # check() refuses every user value that could
        raise RuntimeError(f"{field}: {text!r} reached an #SBATCH line unchecked")
    return f"--{key}={text}"


def directives(job: JobSpec) -> list[str]:
    """The `#SBATCH` options, all derived from the JobSpec."""
    s = job.slurm
    nodes = str(job.nodes.min) if not job.nodes.elastic else f"{job.nodes.min}-{job.nodes.max}"
    out = [
        _directive("job-name", job.name, field="name"),
        _directive("nodes", nodes, field="nodes"),
        _directive("ntasks-per-node", tasks_per_node(job), field="slurm.launcher"),
    ]
    cpus = cpus_per_task(job)
    if cpus is not None:
        out.append(_directive("cpus-per-task", cpus, field="resources.cpus_per_node"))
    gpus = gpu_request(job)
    if gpus is not None:
        out.append(_directive(*gpus, field="gpus_per_node"))
    memory = memory_option(job)
    if memory is not None:
        out.append(_directive("mem", memory, field="resources.memory"))
    if job.time_limit is not None:
        out.append(_directive("time", slurm_time(job.time_limit), field="time_limit"))
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(s, key)
        if value is not None:
            out.append(_directive(key, value, field=f"slurm.{key}"))
    if s.exclusive:
        out.append("--exclusive")
    log = posixpath.join(s.log_dir, "%x-%j.out")
    out.append(_directive("output", log, field="slurm.log_dir"))
    out.append(_directive("error", log, field="slurm.log_dir"))
    out.append("--open-mode=append")
    # Slurm requeues a job whose node failed when the job is requeueable (its JobRequeue=1
    # default): so `restarts` says it explicitly, both ways; the script bounds the count.
    out.append("--requeue" if job.restarts else "--no-requeue")
    signal = signal_option(job)
    if signal is not None:
        out.append(f"--signal={signal}")
    out.extend(s.extra_directives)
    return out


def launch_line(job: JobSpec) -> str:
    """The job step: `srun` with the task layout, the container, then the entry point."""
    s = job.slurm
    parts = ["srun", "--nodes=\"$SLURM_JOB_NUM_NODES\"",
             f"--ntasks-per-node={tasks_per_node(job)}"]
    cpus = cpus_per_task(job)
    if cpus is not None:
        parts.append(f"--cpus-per-task={cpus}")
    parts.append("--kill-on-bad-exit=1")
    command = " ".join(shquote(arg) for arg in (job.command or DEFAULT_COMMAND))
    container: list[str] = []
    if s.container == "pyxis":
        parts += [f"--container-image={shquote(image_forms.pyxis(job.image))}",
                  f"--container-name={shquote(container_name(job))}",
                  "--container-mounts=\"$container_mounts\"", "--container-workdir=\"$PWD\""]
        if s.container_remap_root:
            parts.append("--container-remap-root")
        if s.container_writable:
            parts.append("--container-writable")
    elif s.container == "apptainer":
        container = ["apptainer", "exec", *apptainer_options(job)]
        if posixpath.isabs(s.log_dir):
            container.append('--bind "$job_dir"')
        container += [f"--bind {shquote(m)}" for m in container_mounts(job)]
        container.append(shquote(image_forms.apptainer(job.image)))
    lines = _wrap(parts) + (_wrap(container) if container else []) + [command]
    return " \\\n  ".join(lines)


def apptainer_options(job: JobSpec) -> list[str]:
    """`apptainer exec` options besides the binds: the GPU vendor's, a writable tmpfs."""
    flag = gpu_vendor_flag(job)
    return ([flag] if flag else []) + (["--writable-tmpfs"] if job.slurm.container_writable else [])


def _wrap(parts: list[str], width: int = 88) -> list[str]:
    """Group words into lines of about `width` characters (joined with backslash-newlines)."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 1 + len(part) <= width:
            lines[-1] += " " + part
        else:
            lines.append(part)
    return lines


def _ignored(job: JobSpec) -> list[str]:
    """Job-file settings that have no meaning in an sbatch script (shown in its header)."""
    out = []
    for volume in job.volumes:
        if volume.host_path is None:
            out.append(f"volume {volume.name} ({volume.source}): mount it on the cluster's "
                       f"shared filesystem at {volume.mount}")
        elif job.slurm.container == "none" and volume.host_path != volume.mount:
            out.append(f"volume {volume.name}: without a container {volume.host_path} is not "
                       f"mounted at {volume.mount}")
    if job.slurm.container == "none":
        out.append(f"image {job.image} (slurm.container is none)")
    elif job.slurm.venv:
        out.append(f"slurm.venv {job.slurm.venv} (the container's environment is used)")
    if job.slurm.container_remap_root and job.slurm.container != "pyxis":
        out.append("slurm.container_remap_root (pyxis only)")
    if job.slurm.container_writable and job.slurm.container == "none":
        out.append("slurm.container_writable (no container)")
    return out


def _topology(job: JobSpec) -> str:
    nodes = str(job.nodes)
    per_node = job.nproc_per_node
    gpus = f", {job.gpus_per_node} GPUs per node" if job.gpus_per_node else ""
    if job.slurm.launcher == "torchrun":
        mode = "torchrun mode: one Slurm task per node starts the workers"
    else:
        mode = "srun mode: one Slurm task per process"
    return f"{nodes} nodes x {per_node} processes{gpus}; {mode}"


def slurm_context(job: JobSpec, *, source: str) -> dict:
    """Everything the template needs, computed here so the template only lays it out."""
    s = job.slurm
    job_yaml = job.to_yaml()
    if not job_yaml.endswith("\n"):
        job_yaml += "\n"
    return {
        "version": __version__,
        "source_comment": re.sub(r"[^\x20-\x7e]", "?", source),
        "job_name": job.name,
        "topology": _topology(job),
        "ignored": _ignored(job),
        "directives": directives(job),
        "log_dir": s.log_dir,
        "log_dir_absolute": posixpath.isabs(s.log_dir),
        "finished_marker": finished_marker(job),
        "modules": s.modules,
        "setup": s.setup,
        "venv": s.venv if s.container == "none" else None,
        "nproc_per_node": job.nproc_per_node,
        "restarts": job.restarts,
        "launcher": s.launcher,
        "job_yaml": job_yaml,
        "heredoc_end": HEREDOC_END,
        "env": job.env,
        "secret_env": job.secret_env,
        "container": s.container,
        "mounts": container_mounts(job),
        "requeue": s.requeue,
        "signal_trap": signal_option(job) is not None,
        "stop_grace_s": s.signal_seconds,
        "signal": s.signal,
        "launch": launch_line(job),
    }
