"""The sbatch script for a job: `render_slurm(job) -> str`, the template `slurm/job.sh.j2`
laying out the job's SbatchRequest (request.py; `--via submitit` maps the same request).

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

import math
import posixpath
import re
import sys
from dataclasses import replace
from pathlib import Path

from deploy import __version__, durability, image_forms, units
from deploy.problems import Problem, refuse
from deploy.slurm import directives
from deploy.slurm.request import JOB_FILE, SbatchRequest, container_mounts
from deploy.slurm.template import render_template, shquote
from deploy.spec import JobSpec
from trainer.contract import RESIDENT_VAR, slurm_port_bash, workdir_line, workdir_record

HEREDOC_END = "DDPKIT_JOB_YAML"


def render_slurm(job: JobSpec, *, source: str = "job.yaml") -> str:
    """The sbatch script for `job`; `source` is the job file's name, shown in the header."""
    refuse(job, check(job))
    return render_template("slurm", "job.sh.j2", **slurm_context(job, source=source))


def request(job: JobSpec, *, flavor: None = None) -> SbatchRequest:
    """The target's request verb (deploy/targets.py): the sbatch job as data, after the check."""
    refuse(job, check(job))
    return SbatchRequest.of(job)


def render(job: JobSpec, *, flavor: None = None, source: str = "job.yaml") -> str:
    """The target's render verb (deploy/targets.py): `render_slurm` (Slurm has no flavors)."""
    return render_slurm(job, source=source)


def after_render(job: JobSpec) -> None:
    """sbatch opens `--output` before the script runs and fails the job, silently, when its
    directory is missing: so `ddpkit render slurm job.yaml -o job.sbatch && sbatch job.sbatch`
    works as written, the log directory (relative: to here, where sbatch runs) is created now,
    and the workdir's snapshot the script runs in is written there (`ship`)."""
    path = Path(job.slurm.log_dir)
    if job.workdir is not None:
        print(ship(job, Path.cwd()), file=sys.stderr)
    if path.is_dir():
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        print(f"created {job.slurm.log_dir}/ for the job's log (sbatch needs it before the job starts)",
              file=sys.stderr)
    except OSError as exc:
        print(f"note: could not create {job.slurm.log_dir}/ ({exc.strerror}): create it before sbatch, "
              "which fails a job whose log directory is missing", file=sys.stderr)


def ship(job: JobSpec, submit_dir: Path, *, dry_run: bool = False) -> str:
    """Copy the job's workdir snapshot into its log directory (`submit_dir`/log_dir), where the
    rendered script looks for it by its hash; the line that says what was shipped."""
    from deploy import workdir

    snapshot = workdir.snapshot(job)
    dest = submit_dir / job.slurm.log_dir / snapshot.dir_name(job.name)
    what = f"workdir {snapshot.root} ({snapshot.describe()})"
    if dry_run:
        return f"ddpkit: would ship {what} to {dest}"
    _, written = snapshot.write(dest.parent, job.name)
    return f"ddpkit: {'shipped' if written else 'already there'}: {what} in {dest}"


def check(job: JobSpec, flavor: None = None) -> list[Problem]:
    """Everything an sbatch script (or submitit) cannot do with `job` (deploy/problems.py:
    `ddpkit validate` reports the same lines as `render slurm` and `submit slurm`)."""
    problems = []
    if job.workdir is not None:  # deploy.workdir is imported for a job that ships a tree only
        from deploy import workdir

        problems = workdir.problems(job)
    s = job.slurm
    if s.container != "none":
        problems += image_forms.problems(job.image, s.container)
    problems += durability.slurm_problems(job)
    if s.launcher == "srun" and job.restarts and not s.requeue and not directives.restarts_in_allocation(job):
        problems.append(Problem(
            "restarts", f"{job.restarts} in srun mode, but with slurm.requeue off only a lost node "
            "would requeue the job; a crashed rank ends it (srun mode has no torchrun to restart workers)",
            "set slurm.requeue: true (requeue before the time limit), use slurm.launcher: "
            "torchrun, or set restarts: 0"))
    cpus = job.resources.cpus_per_node
    tasks = directives.tasks_per_node(job)
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
    if not directives.VALUE.match(s.log_dir):
        problems.append(Problem("slurm.log_dir", f"{s.log_dir!r} cannot go into an #SBATCH line",
                                "use letters, digits and _.,:@%+=/|&~- only (no spaces or quotes)"))
    if any(line == HEREDOC_END for line in job.to_yaml().splitlines()):
        problems.append(Problem("(top level)", f"the job contains a line {HEREDOC_END!r}, which "
                                "ends the embedded job file", "change that value"))
    return problems


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


#: The batch shell's resolved log directory (`job_dir=$(cd "$log_dir" && pwd)`), as bash.
JOB_DIR = '"$job_dir"'


def launch_line(request: SbatchRequest, in_allocation: bool = False) -> str:
    """The job step: `srun` with the task layout, the container, then the entry point. Every
    node of the allocation, or with restarts inside it the nodes the batch shell picked."""
    # (a step on fewer nodes than the allocation also names its task count: srun would take
    # the allocation's SLURM_NTASKS and refuse "More processors requested than permitted")
    # the resources of a step that lost a node stay held until slurmctld declares the node
    # DOWN: the next one shares them (--overlap) instead of waiting on "Requested nodes are busy")
    nodes = (['--nodes="$step_nnodes"', '--nodelist="$step_nodes"', '--ntasks="$step_ntasks"', "--overlap"]
             if in_allocation else ['--nodes="$SLURM_JOB_NUM_NODES"'])
    return _srun_line(request, [*nodes, *request.step], " ".join(shquote(arg) for arg in request.argv))


def resident_line(request: SbatchRequest) -> str:
    """The step of the allocation's templates (directives.resident_template): one task on every
    node, in the job steps' container, sharing their CPUs, memory and GPUs (`--overlap`; the
    workers it forks run in its CPU set, so it asks for a job step's), ended by the batch shell;
    a lost node ends only its own task (`--no-kill`, `--kill-on-bad-exit=0`)."""
    step = [opt for opt in request.step if not opt.startswith(("--ntasks-per-node=", "--kill-on-bad-exit"))]
    options = ['--nodes="$SLURM_JOB_NUM_NODES"', "--ntasks-per-node=1", "--overlap", "--no-kill",
               "--kill-on-bad-exit=0", "--mem=0", *step]
    command = f'{shquote(request.argv[0])} -m trainer.warm --resident "${RESIDENT_VAR}"'
    return _srun_line(request, options, command)


def _srun_line(request: SbatchRequest, options: list[str], command: str) -> str:
    """`srun OPTIONS`, the container's options and wrapper, then `command` (bash words)."""
    parts = ["srun", *options]
    pyxis = request.pyxis
    if pyxis is not None:
        parts += [f"--container-image={shquote(pyxis.image)}",
                  '--container-name="$container_name"',
                  "--container-mounts=\"$container_mounts\"", "--container-workdir=\"$PWD\""]
        if pyxis.remap_root:
            parts.append("--container-remap-root")
        if pyxis.writable:
            parts.append("--container-writable")
    container = _bash_words(request.apptainer.argv(JOB_DIR)) if request.apptainer else []
    lines = _wrap(parts) + (_wrap(container) if container else []) + [command]
    return " \\\n  ".join(lines)


def _bash_words(argv: list[str]) -> list[str]:
    """An argv as quoted bash words, `--bind VALUE` kept together (JOB_DIR stays a variable)."""
    words: list[str] = []
    for arg in argv:
        quoted = arg if arg == JOB_DIR else shquote(arg)
        if words and words[-1] == "--bind":
            words[-1] += " " + quoted
        else:
            words.append(quoted)
    return words


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


#: DDPKIT_NNODES in the script: the allocation's node count (of an elastic range: Slurm picks
#: it), or with restarts inside the allocation the step's (the batch shell sets it per step).
NNODES = '"$SLURM_JOB_NUM_NODES"'


def launch_exports(request: SbatchRequest, in_allocation: bool = False) -> dict[str, str]:
    """The launch contract's `export NAME=VALUE`s known before the job runs, quoted for bash
    (the master address and port, and the job file, are computed by the script itself). With
    restarts inside the allocation torchrun restarts nothing: a failed worker ends the step,
    and the batch shell starts the next one on the nodes that still answer."""
    launch_env = replace(request.launch_env, nnodes=NNODES)
    if in_allocation:  # DDPKIT_NNODES is set per step, in the loop
        launch_env = replace(launch_env, nnodes=None, max_restarts=0)
    env = launch_env.to_env()
    return {name: value if value == NNODES else shquote(value) for name, value in env.items()}


def _workdir_context(request: SbatchRequest) -> dict | None:
    """The snapshot the script runs in: its directory in the log dir, what it is, its records."""
    snapshot = request.workdir
    if snapshot is None:
        return None
    from deploy import workdir

    env = workdir.record_env(snapshot)
    return {"dir": request.workdir_dir, "describe": snapshot.describe(),
            "exports": {k: shquote(v) for k, v in env.items()},
            "line": shquote(f"ddpkit: {workdir_line(workdir_record(env))}")}


def slurm_context(job: JobSpec, *, source: str) -> dict:
    """Everything the template needs, computed here so the template only lays it out."""
    request = SbatchRequest.of(job)
    s = job.slurm
    in_allocation = directives.restarts_in_allocation(job)
    job_yaml = request.job_yaml if request.job_yaml.endswith("\n") else request.job_yaml + "\n"
    return {
        "version": __version__,
        "source_comment": re.sub(r"[^\x20-\x7e]", "?", source),
        "job_name": job.name,
        "topology": _topology(job),
        "ignored": _ignored(job),
        # a lost node must not end a job that restarts its step inside the allocation
        "directives": [directives.flag(name, value) for name, value in request.directives]
        + (["--no-kill"] if in_allocation else []),
        "log_dir": s.log_dir,
        "finished_marker": finished_marker(job),
        "setup": request.setup,
        "launch_exports": launch_exports(request, in_allocation),
        "master_port": slurm_port_bash("SLURM_JOB_ID"),
        "job_file": JOB_FILE.format(job_dir="$job_dir", run_id="$job_name", job_id="$SLURM_JOB_ID"),
        "restarts": job.restarts,
        "launcher": s.launcher,
        "job_yaml": job_yaml,
        "heredoc_end": HEREDOC_END,
        "exports": request.exports,
        "pyxis": request.pyxis,
        "requeue": request.requeue,
        "signal_trap": directives.signal_option(job) is not None,
        "signal": s.signal,
        "launch": launch_line(request, in_allocation),
        "resident": resident_line(request) if directives.resident_template(job) else None,
        "resident_var": RESIDENT_VAR,
        "in_allocation": in_allocation,
        "workdir": _workdir_context(request),
        "nodes_min": job.nodes.min,
        "nodes_max": job.nodes.max,
        "tasks_per_node": directives.tasks_per_node(job),
        # the built-in trainer writes FINISHED at its end (a job's own script or command does not)
        "trainer_finishes": bool(finished_marker(job)) and not (job.script or job.module or job.command),
    }
