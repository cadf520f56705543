"""Hangs and stops of your own script (trainer/script_watch.py, trainer/launch/script_stop.py):
how long from the moment a rank stops to the verdict, and to the launcher's exit, on this
machine's `python -m trainer.launch` (what every target runs; 2 ranks, gloo).

Cases, each a real run of a test script of ours:
- stuck after steps: tests/stuck_script.py, rank 1 asleep at step 8 (hang_floor_s 3; steps
  of ~50 ms, so the deadline is the floor): hang start -> verdict -> exit;
- stuck before any step: rank 1 asleep before DDP's first broadcast (timeout_s 10: the
  pre-step deadline is max(floor, timeout_s / 2) = 5 s);
- a stop of a hung script with its own SIGTERM handler (tests/hang_script.py, rank 0 blocked in
  an all-reduce, collective timeout 600 s, stop grace 120 s): SIGTERM -> exit.

The start of a hang is the mtime of the `asleep-rank1` file the script writes just before it
sleeps; the verdict's time is verdict.txt's mtime.

With --k8s and --slurm, the first case on the testbeds too (root; each brought up if it is
down, and left as found): tests/stuck_script.py shipped by `workdir:` as a 2-node x 1-rank job
(Kubernetes: an Indexed Job of ddpkit's test image, loaded into the nodes; Slurm: the
testbed's 2 nodes, the host's virtual environment), rank 1 asleep at step 8. Times from the
job's own lines (one machine, one clock): `asleep-rank1 at T` -> the verdict's `time`
(`ddpkit-hang {json}`), and -> the first `ddpkit status` that says FAILED (polled every 0.5 s).

    python bench/script_hangs.py [--repeats 3] [--k8s] [--slurm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_common import Result, fmt  # noqa: E402
from gpu_bench import free_port  # noqa: E402


def launch(work: Path, name: str, script: str, train: dict, **env: str) -> subprocess.Popen:
    import yaml

    (work / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "script": script, "train": train}))
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DDPKIT_NPROC_PER_NODE": "2",
            "DDPKIT_JOB_FILE": str(work / f"{name}.yaml"), "DDPKIT_MASTER_PORT": str(free_port()), **env}
    return subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=work, env=full,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def hang(work: Path, hang_step: int, train: dict) -> tuple[float, float]:
    """(hang start -> verdict, hang start -> launcher exit) in seconds."""
    shutil.copy(REPO / "tests" / "stuck_script.py", work / "stuck.py")
    proc = launch(work, "hang", "stuck.py", train, HANG_STEP=str(hang_step))
    proc.wait(timeout=600)
    ended = time.time()
    start = (work / "asleep-rank1").stat().st_mtime
    verdict = (work / "runs" / "hang" / "debug" / "attempt-0" / "verdict.txt").stat().st_mtime
    return verdict - start, ended - start


def stop(work: Path) -> float:
    """SIGTERM to the launcher -> its exit, in seconds."""
    shutil.copy(REPO / "tests" / "hang_script.py", work / "hang.py")
    proc = launch(work, "stop", "hang.py", {}, TIMEOUT_S="600", OWN_SIGTERM="1", DDPKIT_STOP_GRACE_S="120")
    while not (work / "asleep-rank1").exists():
        time.sleep(0.1)
    time.sleep(2)  # rank 0 in the all-reduce
    sent = time.monotonic()
    proc.terminate()
    proc.wait(timeout=300)
    return time.monotonic() - sent


def on_testbed(target: str, repeats: int) -> list[tuple[float, float]]:
    """(hang start -> verdict, hang start -> `status` FAILED) of each run on `target`'s testbed."""
    import importlib

    testbed = importlib.import_module(f"deploy.testbed.{target}")
    was_up = testbed.status(quiet=True)
    if not was_up:
        testbed.up()
    try:
        env = {**testbed.client_env(), "PYTHONPATH": str(REPO)}
        image = "ddpkit:0.1"
        if target == "k8s":
            from tests.conftest import K8S_TEST_BASE_IMAGE, K8S_TEST_IMAGE, docker_test_image

            image = docker_test_image(K8S_TEST_IMAGE, K8S_TEST_BASE_IMAGE)
            testbed.load_image(image)
        return [_hang_on(target, env, image, i) for i in range(repeats)]
    finally:
        if not was_up:
            testbed.down()


def _hang_on(target: str, env: dict, image: str, i: int) -> tuple[float, float]:
    import json
    import re

    import yaml

    def ddpkit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deploy", *args], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=300)

    with tempfile.TemporaryDirectory(prefix="ddpkit-script-hangs-") as tmp:
        tree = Path(tmp)
        os.chmod(tree, 0o755)
        shutil.copy(REPO / "tests" / "stuck_script.py", tree / "stuck.py")
        job = {"name": f"bench-hang-{i}", "image": image, "nodes": 2, "procs_per_node": 1, "workdir": ".",
               "script": "stuck.py", "restarts": 0, "env": {"OMP_NUM_THREADS": "1"},
               "resources": {"cpus_per_node": 0.7, "memory": "1Gi", "shm": "64Mi"}, "train": {"hang_floor_s": 3},
               "k8s": {"flavor": "job"}, "slurm": {"venv": sys.prefix, "requeue": False}}
        (tree / "job.yaml").write_text(yaml.safe_dump(job))
        submitted = ddpkit("submit", target, "job.yaml")
        if submitted.returncode != 0:
            raise SystemExit(submitted.stderr)
        handle = submitted.stdout.strip()
        deadline = time.time() + 600
        while not ddpkit("status", handle).stdout.startswith("FAILED"):
            if time.time() > deadline:
                raise SystemExit(f"{handle}: no FAILED in 600 s")
            time.sleep(0.5)
        failed = time.time()
        text = ddpkit("logs", handle, "--all").stdout
        ddpkit("cancel", handle, "--wait", "60")
    start = float(re.search(r"asleep-rank1 at ([0-9.]+)", text).group(1))
    verdict = json.loads(re.search(r"ddpkit-hang (\{.*\})", text).group(1))
    return verdict["time"] - start, failed - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k8s", action="store_true", help="also on the Kubernetes testbed (root)")
    p.add_argument("--slurm", action="store_true", help="also on the Slurm testbed (root)")
    args = p.parse_args()
    r = Result("script_hangs", "Hangs and stops of your own script: detection and exit times")
    rows: dict[str, list[tuple[float, ...]]] = {"stuck after steps (floor 3 s)": [],
                                                "stuck before any step (deadline 5 s)": [],
                                                "SIGTERM on a hang, own handler (grace 120 s)": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="ddpkit-script-hangs-") as tmp:
            rows["stuck after steps (floor 3 s)"].append(hang(Path(tmp), 8, {"hang_floor_s": 3}))
        with tempfile.TemporaryDirectory(prefix="ddpkit-script-hangs-") as tmp:
            rows["stuck before any step (deadline 5 s)"].append(
                hang(Path(tmp), 0, {"hang_floor_s": 3, "timeout_s": 10}))
        with tempfile.TemporaryDirectory(prefix="ddpkit-script-hangs-") as tmp:
            rows["SIGTERM on a hang, own handler (grace 120 s)"].append((float("nan"), stop(Path(tmp))))

    def median(values: list[float]) -> str:
        values = [v for v in values if v == v]
        return fmt(statistics.median(values), ".1f") if values else "-"

    r.text(f"2 ranks, gloo on CPU, {args.repeats} runs each (medians); the collective timeout of the "
           "hang cases is torch's default (30 min for gloo): without the watchdog that is when they would end.")
    r.table("seconds from the hang's start (or the stop signal)",
            ["case", "to the verdict", "to the launcher's exit"],
            [[name, median([v[0] for v in vs]), median([v[1] for v in vs])] for name, vs in rows.items()])
    targets = [t for t, asked in (("k8s", args.k8s), ("slurm", args.slurm)) if asked]
    if targets:
        runs = {t: on_testbed(t, args.repeats) for t in targets}
        r.table("stuck after steps (floor 3 s) on the testbeds, 2 nodes x 1 rank: seconds from the hang's start",
                ["target", "to the verdict", "to `ddpkit status` FAILED", "runs"],
                [[t, median([v[0] for v in vs]), median([v[1] for v in vs]), str(len(vs))] for t, vs in runs.items()])
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
