"""Faults with real processes (CPU, gloo): killed ranks, cut-off checkpoints, stop signals.

Each test starts the real entry points (`ddpkit run --local`, `python -m trainer.launch`,
torchrun, `trainer.train`) and injects the fault from outside: SIGKILL to one worker process,
SIGTERM to every rank, damaged files in the checkpoint directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_util import REPO, launch_env, records, summary, wait_for

pytestmark = pytest.mark.slow


def worker_pids(run_id: str) -> dict[int, int]:
    """{rank: pid} of the live `trainer.train` processes whose DDPKIT_RUN_ID is `run_id`."""
    found: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"trainer.train" not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"DDPKIT_RUN_ID") == run_id.encode() and b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def logged_steps(run_dir: Path) -> list[int]:
    try:
        return [r["step"] for r in records(run_dir) if "loss" in r and not r.get("summary")]
    except (OSError, ValueError):  # not there yet, or a line half-written
        return []


def ddpkit_run(job: Path, cwd: Path, *sets: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "deploy", "run", str(job), "--local", *(a for s in sets for a in ("--set", s))]
    env = {**launch_env(job), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def write_ddpkit_job(tmp: Path, name: str, train: dict, every: int, restarts: int) -> Path:
    import yaml

    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "image": "ddpkit:0.1", "procs_per_node": 2, "restarts": restarts,
        "checkpoint": {"every_steps": every, "keep": 2},
        "train": {"threads": 1, "eval_every_epochs": 0, "plot": False, "log_every_steps": 1, **train},
    }))
    return path


def test_kill_9_of_one_rank_restarts_the_group_and_resumes_bit_for_bit(tmp_path):
    """`ddpkit run --local` with restarts=1: SIGKILL one rank mid-epoch; the group restarts
    (a fresh worker store: trainer.launch docstring), resumes from the newest checkpoint and ends
    with the uninterrupted run's parameters; at most one checkpoint interval is lost."""
    train = {"max_steps": 60, "epochs": 2, "data_samples": 4096, "lr": 0.05, "momentum": 0.9}
    every = 10
    whole = ddpkit_run(write_ddpkit_job(tmp_path, "whole", train, every, 0), tmp_path)
    out, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out[-3000:]

    job = write_ddpkit_job(tmp_path, "killed", train, every, 1)
    run_dir = tmp_path / "runs" / "killed"
    proc = ddpkit_run(job, tmp_path)
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 25, 240, "25 training steps")
        victim = worker_pids("killed")[1]
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "connectFullMesh failed" not in out

    recs = records(run_dir)
    resumed = [i for i, r in enumerate(recs) if r.get("event") == "resumed"]
    assert len(resumed) == 1, "the group restarted once and resumed from a checkpoint"
    before = [r["step"] for r in recs[: resumed[0]] if "loss" in r]
    resumed_at = recs[resumed[0]]["step"]
    lost = max(before) - resumed_at
    print(f"kill -9 at step {max(before)}: resumed from step {resumed_at}, {lost} steps lost "
          f"(checkpoint every {every})")
    assert resumed_at % every == 0 and 0 <= lost <= every
    a, b = summary(tmp_path / "runs" / "whole"), summary(run_dir)
    assert b["status"] == "completed" and b["steps"] == a["steps"] == 60
    assert b["resumed_from_step"] == resumed_at
    assert b["final_params_sha256"] == a["final_params_sha256"] is not None
