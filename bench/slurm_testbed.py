"""Timings on the local 2-node Slurm testbed (root), printed side by side with ratios.

  - testbed up / down (cold: the cluster is brought down first)
  - examples/quickstart-2node.yaml (2 nodes x 2 gloo processes) from `ddpkit submit slurm` to
    COMPLETED, in torchrun mode and in srun mode, against the same job as local processes
    (`ddpkit run --local`: one node, four processes, no Slurm)
  - launch to first step of each (the trainer's `first_step_s`)
  - the preemption cycle: USR2 to the batch shell -> checkpoint -> `scontrol requeue` ->
    running again (restart 1)

Usage: sudo python bench/slurm_testbed.py [--repeats N]

A testbed that is already up is used and left up (up/down are then not timed); one that is
down is brought up, timed, and taken down again. The tests' lock file is respected.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_common import Result, Stats, fmt, ratio  # noqa: E402

from deploy.slurm import submit as submit_slurm  # noqa: E402
from deploy.testbed import slurm as testbed  # noqa: E402

JOB = REPO / "examples" / "quickstart-2node.yaml"
QUIET = ["--set", "train.plot=false"]


def ddpkit(*args: str, cwd: Path, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "deploy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"ddpkit {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def wait(handle: str, env: dict, want: str, restarts: str | None = None) -> None:
    run = lambda argv, **kw: subprocess.run(argv, env=env, **kw)  # noqa: E731
    while True:
        state = submit_slurm.status(handle, runner=run)
        if state == want and (restarts is None or
                              (submit_slurm.show_job(handle, runner=run) or {}).get("Restarts") == restarts):
            return
        if state in submit_slurm.TERMINAL and state != want:
            raise SystemExit(f"{handle} ended {state}")
        time.sleep(0.1)


def submit_to_completed(env: dict, launcher: str) -> tuple[float, float | None]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        handle = ddpkit("submit", "slurm", str(JOB), "--set", f"slurm.venv={sys.prefix}",
                        "--set", f"slurm.launcher={launcher}", *QUIET, cwd=Path(tmp), env=env)
        wait(handle, env, "SUCCEEDED")
        return time.perf_counter() - start, first_step_of(Path(tmp))


def local_run(env: dict) -> tuple[float, float | None]:
    with tempfile.TemporaryDirectory() as tmp:
        t = timed(lambda: ddpkit("run", str(JOB), "--local", "--set", "nodes=1",
                                 "--set", "procs_per_node=4", *QUIET, cwd=Path(tmp), env=env))
        return t, first_step_of(Path(tmp))


def preemption_cycle(env: dict) -> tuple[float, float]:
    """(USR2 -> requeued and running again, USR2 -> completed after resuming)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        handle = ddpkit("submit", "slurm", str(JOB), "--set", f"slurm.venv={sys.prefix}",
                        "--set", "train.max_steps=120", "--set", "train.epochs=100", *QUIET,
                        cwd=work, env=env)
        metrics = work / "runs" / "quickstart-2node" / "metrics.jsonl"
        while not metrics.exists() or '"step": 30' not in metrics.read_text():
            time.sleep(0.1)
        start = time.perf_counter()
        subprocess.run(["scancel", "--batch", "--signal=USR2", submit_slurm.job_id(handle)],
                       env=env, check=True)
        wait(handle, env, "RUNNING", restarts="1")
        running = time.perf_counter() - start
        wait(handle, env, "SUCCEEDED")
        summary = [json.loads(line) for line in metrics.read_text().splitlines() if '"summary"' in line]
        assert summary[-1]["resumed_from_step"], summary
        return running, time.perf_counter() - start


def first_step_of(work: Path) -> float | None:
    metrics = work / "runs" / "quickstart-2node" / "metrics.jsonl"
    try:
        last = json.loads(metrics.read_text().splitlines()[-1])
    except (OSError, IndexError, json.JSONDecodeError):
        return None
    return last.get("first_step_s") if last.get("summary") else None


def lock_testbed(wait_s: float):
    """The lock the end-to-end tests hold while they use the testbed; None if still busy."""
    import fcntl

    lock = open(f"{testbed.testbed_dir()}.lock", "w")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                return None
            time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--lock-wait", type=float, default=120, help="seconds to wait for a busy testbed")
    args = parser.parse_args()
    r = Result("slurm_testbed", "Slurm testbed: submit to completion, launch to first step, preemption")
    if os.geteuid() != 0:
        r.skip("needs root: the testbed uses network namespaces")
        r.save()
        return
    lock = lock_testbed(args.lock_wait)
    if lock is None:
        r.skip(f"the Slurm testbed was in use by another session for {args.lock_wait:.0f} s (its lock file)")
        r.save()
        return
    env = testbed.client_env()
    env["PYTHONPATH"] = str(REPO)

    # Never take down a testbed somebody else brought up: up/down are timed only when it was down.
    was_up = testbed.status(quiet=True)
    t_up = None if was_up else timed(testbed.up)
    rows: dict[str, list[float]] = {"torchrun": [], "srun": [], "local": []}
    first: dict[str, list[float]] = {"torchrun": [], "srun": [], "local": []}
    cycles = []
    t_down = None
    try:
        for _ in range(args.repeats):  # interleaved: machine noise hits every mode alike
            for mode in ("torchrun", "srun"):
                t, f = submit_to_completed(env, mode)
                rows[mode].append(t)
                first[mode].append(f)
            t, f = local_run(env)
            rows["local"].append(t)
            first["local"].append(f)
            cycles.append(preemption_cycle(env))
    finally:
        if not was_up:
            t_down = timed(testbed.down)
        lock.close()

    med = {k: Stats(v) for k, v in rows.items()}
    fst = {k: Stats(v) for k, v in first.items()}
    r.text(f"`examples/quickstart-2node.yaml` (2 nodes x 2 gloo processes, 40 steps) on the local "
           f"2-node Slurm testbed (real slurmctld + 2 slurmd in network namespaces), {args.repeats} "
           "repeat(s), interleaved with the same job as 4 local processes (`ddpkit run --local`). "
           "First step: from the launcher's start on the node to rank 0's first optimizer step "
           "(the trainer's `first_step_s`).")
    base = med["local"]["median"]
    r.table("submit to COMPLETED and launch to first step, median (min-max, n)",
            ["mode", "submit -> COMPLETED, s", "vs local", "launch -> first step, s"], [
                ["torchrun mode (1 task per node)", med["torchrun"].fmt(".1f"),
                 fmt(ratio(med["torchrun"]["median"], base), ".2f"), fst["torchrun"].fmt(".1f")],
                ["srun mode (1 task per process)", med["srun"].fmt(".1f"),
                 fmt(ratio(med["srun"]["median"], base), ".2f"), fst["srun"].fmt(".1f")],
                ["same job, 4 local processes", med["local"].fmt(".1f"), "1.00", fst["local"].fmt(".1f")],
            ])
    running, done = Stats([c[0] for c in cycles]), Stats([c[1] for c in cycles])
    r.table("testbed and preemption (USR2 to the batch shell at step 30 of 120)", ["event", "seconds"], [
        ["testbed up (cold)", fmt(t_up, ".1f") if t_up is not None else "not measured: it was already up"],
        ["testbed down", fmt(t_down, ".1f") if t_down is not None else "not measured: left up as found"],
        ["USR2 -> checkpointed, requeued, running again", running.fmt(".1f")],
        ["USR2 -> resumed and completed", done.fmt(".1f")],
    ])
    r.doc["data"] = {"launch": [
        {"target": "Slurm testbed, torchrun mode (2 nodes x 2)", "first_step_s": fst["torchrun"],
         "end_to_end_s": med["torchrun"]},
        {"target": "Slurm testbed, srun mode (2 nodes x 2)", "first_step_s": fst["srun"], "end_to_end_s": med["srun"]},
        {"target": "local processes (1 x 4), beside the Slurm runs", "first_step_s": fst["local"],
         "end_to_end_s": med["local"]},
    ]}
    r.save()


if __name__ == "__main__":
    main()
