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

    python bench/script_hangs.py [--repeats 3]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
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
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
