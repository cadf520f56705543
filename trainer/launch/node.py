"""The node's launcher, `python -m trainer.launch` (trainer/launch/__main__.py): what every
target starts on each node. It reads the job file's settings and what the node sees (its CPUs),
plans (trainer/launch/plan.py), then waits for the master where the plan says so and runs
torchrun supervised (trainer/launch/supervise.py) or execs the worker; the lines of a context
whose nodes share one file go through the relay (trainer/launch/relay.py).

Non-master nodes first wait for the master's rendezvous port with a real TCP connect and a
bounded backoff (DNS answering is not enough), then fail with a message naming host:port.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer import attempts, contract, gpus
from trainer.contract import (
    EXIT_BAD_CONFIG,
    EXIT_FAILURE,
    EXIT_STOPPED_UNSAVED,
    JOB_FILE_VAR,
    LAUNCH_T0_VAR,
    NPROC_PER_NODE_VAR,
    PREFLIGHT_ONLY_VAR,
    RUN_DIR_VAR,
    WARM_VAR,
)
from trainer.launch.plan import (
    GUARD,
    PREFLIGHT,
    TRAINER,
    CPUs,
    Env,
    LaunchError,
    NodePlan,
    endpoint,
    plan_launch,
)
from trainer.launch.relay import TAGGED_CONTEXTS, end_relay, start_relay
from trainer.launch.supervise import supervise


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


def node_cpus(job: JobSettings) -> CPUs:
    try:
        ids = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        ids = ()
    affinity = len(ids) or os.cpu_count() or 1
    return CPUs(affinity, cgroup_cpus(), job.cpus_per_node, job.threads, ids)


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
        # Accelerate under torchrun on CPUs runs each rank alone (and exits 0) unless told to use
        # the CPU: a CPU job says so for it (the job's `env:` wins)
        plan.env.setdefault("ACCELERATE_USE_CPU", "1")
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
    if (tree := contract.workdir_record(os.environ)) is not None:  # what `status`/`why` say it ran
        log(f"{contract.workdir_line(tree)} in {os.getcwd()}")
    if plan.wait_for:
        try:
            took = wait_for_master(*plan.wait_for, timeout_s=job.timeout_s, log=log)
        except LaunchError as e:
            return refuse(job, log, str(e), EXIT_FAILURE, plan.node_rank or 0)
        if job.preflight or job.entry == PREFLIGHT:
            log(f"preflight: master {endpoint(*plan.wait_for)} resolved and accepted a TCP connection after {took:.2f}s")
    if plan.mode == "torchrun":
        nproc = int(plan.env.get(NPROC_PER_NODE_VAR) or 1)
        one_node = plan.argv[plan.argv.index("--nnodes") + 1] == "1"
        code = supervise(plan.argv, plan.env, log, attempts.LaunchRecord(run_dir_of(job), plan.node_rank or 0, nproc),
                         warm=plan.warm, warm_now=plan.warm and one_node, store=plan.wait_for,
                         script=RUN_DIR_VAR in plan.env)
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
