"""Submit, watch and cancel Slurm jobs: handles `slurm://JOBID`.

`submit` pipes the rendered script into `sbatch --parsable` (default), or hands submitit the
same SbatchRequest (`--via submitit`, deploy/slurm/submitit.py). `status` reads
`scontrol show job` (Slurm keeps a finished job there for MinJobAge, 5 minutes by default) and
falls back to `sacct` when the cluster has accounting (deploy/slurm/sacct.py: `--json` where
sacct has it, else `-P`). `logs` reads the job's output file
named by Slurm itself (StdOut), so it works for both ways of submitting.

Every Slurm command goes through `runner` (default `subprocess.run`), so unit tests can swap in
a fake; the end-to-end tests use the real testbed cluster.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from deploy.errors import RuntimeFailure, UserError
from deploy.kube import TERMINAL_STATES
from deploy.logs import LineWriter, Query, pick_tagged, print_file
from deploy.problems import Problem, refuse
from deploy.progress import Report, last_record, tail_of_file
from deploy.slurm import sacct
from trainer.contract import parse_workdir_line

Runner = Callable[..., subprocess.CompletedProcess]

#: Slurm job states in the shared vocabulary (PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED,
#: CANCELLED). A pending job that has been requeued before is RESTARTING. PREEMPTED is an
#: ended job: a preempted job that Slurm requeues (PreemptMode=REQUEUE, requeueable) shows
#: REQUEUED then PENDING with Restarts counted, which are RESTARTING; one left PREEMPTED is
#: not requeued (requeue off, --no-requeue, PreemptMode=CANCEL) and is over, as a pod evicted
#: from a Job with no restarts left is Failed.
STATES = {
    "PENDING": "PENDING", "CONFIGURING": "PENDING", "SUSPENDED": "PENDING",
    "REQUEUE_HOLD": "PENDING", "SPECIAL_EXIT": "FAILED",
    "RUNNING": "RUNNING", "COMPLETING": "RUNNING", "SIGNALING": "RUNNING", "STAGE_OUT": "RUNNING",
    "RESIZING": "RUNNING",
    "REQUEUED": "RESTARTING", "REQUEUE_FED": "RESTARTING", "PREEMPTED": "FAILED",
    "COMPLETED": "SUCCEEDED",
    "CANCELLED": "CANCELLED", "REVOKED": "CANCELLED",
    "FAILED": "FAILED", "TIMEOUT": "FAILED", "NODE_FAIL": "FAILED", "OUT_OF_MEMORY": "FAILED",
    "BOOT_FAIL": "FAILED", "DEADLINE": "FAILED",
}
TERMINAL = TERMINAL_STATES
_HANDLE = re.compile(r"^(?:slurm://)?([0-9]+(?:_[0-9]+)?)$")
_NO_SLURM = ("{cmd} not found: run this on a Slurm login node, or try the local testbed: "
             "`sudo ddpkit testbed slurm up` then `eval \"$(ddpkit testbed slurm env)\"`")


def job_id(handle: str) -> str:
    """`slurm://1234` (or a bare `1234`) -> `1234`."""
    match = _HANDLE.match(handle.strip())
    if not match:
        raise UserError(f"{handle!r} is not a Slurm job handle: expected slurm://JOBID, e.g. slurm://1234")
    return match.group(1)


def _run(runner: Runner, argv: list[str], *, input: str | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    """Run one Slurm client command; a missing command or a refusal is one clear line."""
    if runner is subprocess.run and shutil.which(argv[0]) is None:
        raise RuntimeFailure(_NO_SLURM.format(cmd=argv[0]))
    try:
        proc = runner(argv, input=input, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RuntimeFailure(_NO_SLURM.format(cmd=argv[0])) from None
    except subprocess.TimeoutExpired:
        raise RuntimeFailure(f"{argv[0]} did not answer within 120 s: is slurmctld up?") from None
    if check and proc.returncode != 0:
        raise RuntimeFailure(f"{argv[0]} failed: {_last_line(proc.stderr or proc.stdout)}")
    return proc


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


# ---------------------------------------------------------------------------------------------
# submit


def submit(job, *, source: str = "job.yaml", via: str = "sbatch", dry_run: bool = False,
           runner: Runner = subprocess.run, cwd: str | os.PathLike | None = None) -> str:
    """Submit `job`; return its handle `slurm://JOBID` (with dry_run: sbatch --test-only's answer).

    Before anything reaches Slurm: the Slurm target's checks (what `ddpkit validate` reports),
    and every `secret_env` variable must be set here (sbatch passes this environment on to
    the job; a missing one would fail the job only after its wait in the queue)."""
    if via not in ("sbatch", "submitit"):
        raise UserError(f"--via {via}: use sbatch or submitit")
    from deploy.slurm.render import check

    problems = check(job) + missing_secrets(job, os.environ)
    if via == "submitit":
        from deploy.slurm import submitit as via_submitit

        problems += via_submitit.problems(job)
    refuse(job, problems)
    if via == "submitit":
        if dry_run:
            raise UserError("--dry-run is not available with --via submitit; use --via sbatch")
        return _submit_submitit(job, cwd=cwd)
    from deploy.slurm.render import render_slurm, ship

    script = render_slurm(job, source=source)
    submit_dir = Path(cwd or os.getcwd())
    if job.workdir is not None:  # the snapshot first: the script runs nothing without it
        print(ship(job, submit_dir, dry_run=dry_run), file=sys.stderr)
    # Slurm does not create the output directory; a job whose log cannot be opened just fails
    (submit_dir / job.slurm.log_dir).mkdir(parents=True, exist_ok=True)
    argv = ["sbatch", "--parsable", f"--chdir={submit_dir}"]
    if dry_run:
        proc = _run(runner, [*argv, "--test-only"], input=script, check=False)
        if proc.returncode != 0:
            raise RuntimeFailure(f"sbatch --test-only refused the job: {_last_line(proc.stderr)}")
        return _last_line(proc.stderr or proc.stdout)
    proc = _run(runner, argv, input=script, check=False)
    if proc.returncode != 0:
        raise RuntimeFailure(f"sbatch refused the job: {_last_line(proc.stderr or proc.stdout)}")
    jobid = proc.stdout.strip().split(";")[0]
    if not _HANDLE.match(jobid):
        raise RuntimeFailure(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return f"slurm://{jobid}"


def missing_secrets(job, environ) -> list[Problem]:
    """secret_env variables the submitting environment lacks (Slurm has no Secrets)."""
    return [Problem(f"secret_env.{i}.name", f"{secret.name} is not set in this environment, and "
                    f"on Slurm the job gets it only from there (Kubernetes Secret "
                    f"{secret.secret}/{secret.key} does not exist on Slurm)",
                    f"export {secret.name} before `ddpkit submit slurm`")
            for i, secret in enumerate(job.secret_env) if secret.name not in environ]


def _submit_submitit(job, *, cwd) -> str:
    """submitit's SlurmExecutor for the job's SbatchRequest, running `SlurmLaunch` on every task
    (deploy/slurm/submitit.py maps the request)."""
    if importlib.util.find_spec("submitit") is None:
        raise RuntimeFailure("--via submitit needs the Python package 'submitit': "
                             "pip install 'ddpkit[slurm]'")
    if shutil.which("sbatch") is None:
        raise RuntimeFailure(_NO_SLURM.format(cmd="sbatch"))
    from deploy.slurm import submitit as via_submitit
    from deploy.slurm.request import SbatchRequest

    request = SbatchRequest.of(job)
    if job.workdir is not None:
        from deploy.slurm.render import ship

        print(ship(job, Path(cwd or os.getcwd())), file=sys.stderr)
    executor = via_submitit.executor(request, Path(cwd or os.getcwd()))
    try:
        submitted = executor.submit(via_submitit.SlurmLaunch(request))
    except Exception as exc:  # submitit wraps sbatch's refusal in its own exception types
        raise RuntimeFailure(f"submitit could not submit the job: {_last_line(str(exc))}") from None
    return f"slurm://{submitted.job_id}"


# ---------------------------------------------------------------------------------------------
# status, logs, cancel


def show_job(handle: str, *, runner: Runner = subprocess.run) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict, or None when slurmctld no longer knows the job."""
    jobid = job_id(handle)
    proc = _run(runner, ["scontrol", "show", "job", "-o", jobid], check=False)
    if proc.returncode != 0:
        if "invalid job id" in (proc.stderr + proc.stdout).lower():
            return None
        raise RuntimeFailure(f"scontrol show job {jobid} failed: {_last_line(proc.stderr)}")
    return parse_scontrol(proc.stdout.splitlines()[0] if proc.stdout.strip() else "")


def parse_scontrol(line: str) -> dict[str, str]:
    """`Key=Value Key=Value ...` (one job, `-o` output) to a dict; values may contain spaces
    only where Slurm puts them (Command, Comment, Reason), which end at the next ` Key=`."""
    fields: dict[str, str] = {}
    for match in re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=(.*?)(?=\s[A-Za-z][A-Za-z0-9_/:]*=|$)", line):
        fields.setdefault(match.group(1), match.group(2))
    return fields


def status(handle: str, *, runner: Runner = subprocess.run) -> str:
    """The job's state in the shared vocabulary."""
    info = show_job(handle, runner=runner)
    if info is not None:
        return _state(info)
    job = accounted(handle, runner=runner)
    return _shared(job.state, job.restarts)


def _state(info: dict[str, str]) -> str:
    raw = info.get("JobState", "")
    return _shared(raw.split()[0].rstrip("+") if raw else "", int(info.get("Restarts", "0") or 0))


def _shared(raw: str, restarts: int) -> str:
    """Slurm's state word in the shared vocabulary; a pending job started before is RESTARTING."""
    state = STATES.get(raw, "FAILED") if raw else "PENDING"
    return "RESTARTING" if state == "PENDING" and restarts > 0 else state


def accounted(handle: str, *, runner: Runner = subprocess.run) -> sacct.Ended:
    """What accounting kept of a job slurmctld no longer knows: `sacct --json`, or `sacct -P`
    where this sacct has no JSON (deploy/slurm/sacct.py reads both)."""
    jobid = job_id(handle)
    proc = _run(runner, ["sacct", "--json", "-j", jobid], check=False)
    try:
        job = sacct.from_json(proc.stdout if proc.returncode == 0 else "", jobid)
    except sacct.NotJson:  # a sacct without --json (or one that refused): the parsable form
        proc = _run(runner, ["sacct", "-n", "-P", "-o", ",".join(sacct.PARSABLE_FIELDS), "-j", jobid],
                    check=False)
        job = sacct.from_parsable(proc.stdout, jobid) if proc.returncode == 0 else None
    if job is None:
        said = f" (sacct: {_last_line(proc.stderr)})" if proc.returncode != 0 else ""
        raise RuntimeFailure(f"Slurm no longer knows job {jobid} and accounting has no record of "
                             f"it{said}: look in the job's log directory")
    return job


#: Why Slurm ended a job, for states that say more than FAILED.
_ENDED_BECAUSE = {
    "NODE_FAIL": "a node of the job stopped responding (Slurm marked it DOWN)",
    "TIMEOUT": "the job reached its time limit",
    "OUT_OF_MEMORY": "a task ran out of memory",
    "BOOT_FAIL": "a node failed to boot",
    "DEADLINE": "the job reached its deadline",
    "PREEMPTED": "preempted, and Slurm does not requeue it (not requeueable, or PreemptMode=CANCEL): "
                 "submit it again to resume from the checkpoint",
}


def describe(handle: str, *, runner: Runner = subprocess.run) -> str:
    """`ddpkit status`'s line: the shared state first, then what Slurm says when it is more
    than that state, e.g. `FAILED (NODE_FAIL: a node of the job stopped responding ...; not
    requeued: the job is not requeueable (restarts: 0))`."""
    info = show_job(handle, runner=runner)
    return _describe_ended(accounted(handle, runner=runner)) if info is None else _describe(info)


def _describe(info: dict[str, str]) -> str:
    state = _state(info)
    raw = info.get("JobState", "").split(" ")[0].rstrip("+")
    reason = info.get("Reason", "None")
    notes = []
    if raw in _ENDED_BECAUSE:
        notes.append(f"{raw}: {_ENDED_BECAUSE[raw]}")
    elif reason not in ("None", ""):
        notes.append(f"Slurm reason: {reason}")
    if state == "FAILED" and raw == "NODE_FAIL" and info.get("Requeue") == "0":
        notes.append("not requeued: the job is not requeueable (restarts: 0)")
    if state == "RESTARTING":
        notes.append(f"restart {info.get('Restarts', '?')}")
    return f"{state} ({'; '.join(notes)})" if notes else state


def _describe_ended(job: sacct.Ended) -> str:
    """The same line for a job only accounting still knows: the state's reason, who cancelled
    it, how its script or a step ended (`exit code N`, `killed by signal N (SIGNAME)`), the
    time it ran against its limit, its restarts and nodes."""
    state = _shared(job.state, job.restarts)
    notes = []
    if job.state in _ENDED_BECAUSE:
        notes.append(f"{job.state}: {_ENDED_BECAUSE[job.state]}")
    elif job.reason:
        notes.append(f"Slurm reason: {job.reason}")
    if job.state == "CANCELLED" and job.cancelled_by:
        notes.append(f"cancelled by {job.cancelled_by}")
    if job.state == "FAILED":
        notes.append(_ended_how(job))
    if job.state == "TIMEOUT" and job.elapsed_s is not None and job.limit_s:
        notes.append(f"ran {job.elapsed_s} s of its {job.limit_s} s limit")
    if job.restarts:
        notes.append(f"restarts: {job.restarts}")
    if job.failed_node:
        notes.append(f"failed node: {job.failed_node}")
    if job.nodes and state in TERMINAL:
        notes.append(f"nodes: {job.nodes}")
    return f"{state} ({'; '.join(n for n in notes if n)})" if any(notes) else state


def _ended_how(job: sacct.Ended) -> str:
    """`exit code 1`, or `killed by signal 9 (SIGKILL)`, of the script or else of a step."""
    step = job.killed_step()
    if job.signal:
        return f"killed by signal {job.signal} ({_signal_name(job.signal)})"
    if job.exit_code:
        return f"exit code {job.exit_code}"
    if step is not None:
        return f"step {step.id} killed by signal {step.signal} ({_signal_name(step.signal)})"
    return ""


def _signal_name(number: int) -> str:
    from trainer.attempts import signal_name

    return signal_name(-number) or "unknown"


def log_path(handle: str, *, runner: Runner = subprocess.run) -> Path:
    """The job's output file, as Slurm names it (StdOut, relative to WorkDir)."""
    info = show_job(handle, runner=runner)
    if info is None:
        raise RuntimeFailure(f"Slurm no longer knows job {job_id(handle)}: its log is in the "
                             "job's log directory (slurm.log_dir, default logs/)")
    return _log_path(info)


def _log_path(info: dict[str, str]) -> Path:
    path = Path(info.get("StdOut", ""))
    return path if path.is_absolute() else Path(info.get("WorkDir", ".")) / path


def report(handle: str, *, runner: Runner = subprocess.run) -> Report:
    """`ddpkit status`'s report: the state line, the trainer's newest progress record from the
    job's output file (the login node reads it where the job wrote it: a shared file system),
    and how long the job waited in the queue (StartTime - SubmitTime)."""
    info = show_job(handle, runner=runner)
    if info is None:
        return Report(_describe_ended(accounted(handle, runner=runner)))
    record = last_record(tail_of_file(_log_path(info))) if info.get("StdOut") else None
    return Report(_describe(info), record, _waited(info), _workdir(info))


def _workdir(info: dict[str, str]) -> dict | None:
    """The tree a `workdir:` job runs: the batch script says it first thing in the job's log."""
    if not info.get("StdOut"):
        return None
    try:
        with _log_path(info).open("rb") as fh:
            return parse_workdir_line(fh.read(64 * 1024).decode("utf-8", "replace"))
    except OSError:
        return None


def why(handle: str, *, runner: Runner = subprocess.run) -> list[str]:
    """`ddpkit why`: Slurm's state and reason (accounting's, once slurmctld forgot the job), and
    the job's output file (deploy/why.py)."""
    from deploy.why import explain

    info = show_job(handle, runner=runner)
    if info is None:
        return explain(_describe_ended(accounted(handle, runner=runner)), "")
    text = tail_of_file(_log_path(info)) if info.get("StdOut") else ""
    return explain(_describe(info), text, run_dir(info), _workdir(info))


def run_dir(info: dict[str, str]) -> Path | None:
    """The job's run directory (trainer/attempts.py), where this host can read it (a shared file
    system, the usual case on Slurm): `<train.output_dir>/<job name>` of the job file the batch
    script kept beside its output file, relative to the job's working directory."""
    import yaml

    if not info.get("StdOut") or not info.get("JobName"):
        return None
    log = _log_path(info)
    job_file = log.parent / f"{info['JobName']}-{info.get('JobId', '')}.job.yaml"
    try:
        job = yaml.safe_load(job_file.read_text()) or {}
        output = Path(str((job.get("train") or {}).get("output_dir") or "runs"))
    except (OSError, ValueError, AttributeError):
        return None
    found = (output if output.is_absolute() else Path(info.get("WorkDir", ".")) / output) / info["JobName"]
    return found if found.is_dir() else None


def _waited(info: dict[str, str]) -> float | None:
    """Seconds from the (last) submission to the start; None before the start."""
    import datetime

    if info.get("JobState", "").startswith(("PENDING", "CONFIGURING")):
        return None  # StartTime is Slurm's estimate until then
    try:
        submitted, started = (datetime.datetime.fromisoformat(info[k]) for k in ("SubmitTime", "StartTime"))
    except (KeyError, ValueError):
        return None  # "Unknown" until it starts
    return (started - submitted).total_seconds() if started >= submitted else None


def logs(handle: str, rank: int | None = None, follow: bool = False, *,
         query: Query | None = None, runner: Runner = subprocess.run, out=None,
         poll_s: float = 1.0) -> int:
    """Print the lines of the job's output file that `query` asks for (deploy/logs.py; default:
    node 0); with follow, keep printing until the job ends.

    Slurm writes one file per job with every node's output; `trainer.launch` starts each line
    of a node with `[NODE/RANK] ` (trainer.contract NODE_LINE_TAG), so `--rank N` keeps node N's
    lines, `--worker-rank R` the lines of global rank R (its task in srun mode; in torchrun mode
    the lines that name it), `--all` all of them, tags kept. The batch shell's own lines (no tag)
    are always printed. `--attempt K` / `--previous`: what the job's K-th (the last but one)
    start wrote, from the batch shell's `restart K` line (the file is opened for appending).
    """
    query = query or Query(rank=rank)
    out = out or sys.stdout
    path = log_path(handle, runner=runner)
    lines = LineWriter(out, pick_tagged(query))
    return print_file(path, lines, query, follow=follow, poll_s=poll_s,
                      ended=lambda: status(handle, runner=runner) in TERMINAL,
                      missing=f"{path} does not exist yet (is the job still pending?)")


def cancel(handle: str, *, runner: Runner = subprocess.run, wait_s: float = 30.0) -> None:
    """`scancel`, then wait (up to wait_s; 0: not at all) until Slurm reports the job ended."""
    jobid = job_id(handle)
    proc = _run(runner, ["scancel", jobid], check=False)
    if proc.returncode != 0:
        raise RuntimeFailure(f"scancel {jobid} failed: {_last_line(proc.stderr or proc.stdout)}")
    if wait_s <= 0:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        info = show_job(handle, runner=runner)
        if info is None or not info.get("JobState", "").startswith(("RUNNING", "COMPLETING", "PENDING", "CONFIGURING")):
            return
        time.sleep(0.5)
    raise RuntimeFailure(f"job {jobid} is still running {wait_s:.0f} s after scancel")
