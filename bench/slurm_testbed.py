"""Timings on the local 2-node Slurm testbed (root), printed side by side with ratios.

  - testbed up / down (cold: the cluster is brought down first)
  - examples/quickstart-2node.yaml (2 nodes x 2 gloo processes) from `ddpkit submit slurm` to
    COMPLETED, in torchrun mode and in srun mode, against the same job as local processes
    (`ddpkit run --local`: one node, four processes, no Slurm)
  - the preemption cycle: USR2 to the batch shell -> checkpoint -> `scontrol requeue` ->
    running again (restart 1)

Usage: sudo python bench/slurm_testbed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deploy.submit import slurm as submit_slurm  # noqa: E402
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


def submit_to_completed(env: dict, launcher: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        handle = ddpkit("submit", "slurm", str(JOB), "--set", f"slurm.venv={sys.prefix}",
                        "--set", f"slurm.launcher={launcher}", *QUIET, cwd=Path(tmp), env=env)
        wait(handle, env, "SUCCEEDED")
        return time.perf_counter() - start


def local_run(env: dict) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        return timed(lambda: ddpkit("run", str(JOB), "--local", "--set", "nodes=1",
                                    "--set", "procs_per_node=4", *QUIET, cwd=Path(tmp), env=env))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the testbed uses network namespaces")
    env = testbed.client_env()
    env["PYTHONPATH"] = str(REPO)

    if testbed.status(quiet=True):
        testbed.down()
    t_up = timed(testbed.up)
    rows: dict[str, list[float]] = {"torchrun": [], "srun": [], "local": []}
    cycles = []
    try:
        for _ in range(args.repeats):  # interleaved: machine noise hits every mode alike
            rows["torchrun"].append(submit_to_completed(env, "torchrun"))
            rows["srun"].append(submit_to_completed(env, "srun"))
            rows["local"].append(local_run(env))
            cycles.append(preemption_cycle(env))
    finally:
        t_down = timed(testbed.down)

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nSlurm testbed on {os.cpu_count()} CPUs, {args.repeats} repeat(s), medians")
    print(f"  testbed up                              {t_up:7.1f} s")
    print(f"  testbed down                            {t_down:7.1f} s")
    print("  quickstart-2node (2x2 gloo, 40 steps), submit -> COMPLETED:")
    print(f"    torchrun mode (1 task per node)       {med['torchrun']:7.1f} s")
    print(f"    srun mode (1 task per process)        {med['srun']:7.1f} s   "
          f"{med['srun'] / med['torchrun']:.2f}x torchrun mode")
    print(f"    same job as 4 local processes         {med['local']:7.1f} s   "
          f"Slurm torchrun mode is {med['torchrun'] / med['local']:.2f}x local")
    running = statistics.median(c[0] for c in cycles)
    done = statistics.median(c[1] for c in cycles)
    print("  preemption (USR2 to the batch shell at step 30 of 120):")
    print(f"    -> checkpointed, requeued, running    {running:7.1f} s")
    print(f"    -> resumed and completed              {done:7.1f} s")


if __name__ == "__main__":
    main()
