"""Helpers for tests that start real trainer processes (`python -m trainer.launch`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from deploy.run.local import free_port  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parent.parent
# Small and quiet by default: 1 thread per rank, no eval, no plot.
FAST = {"threads": 1, "eval_every_epochs": 0, "plot": False, "log_every_steps": 1}


def write_job(tmp: Path, name: str = "t", train: dict | None = None, checkpoint: dict | None = None) -> Path:
    path = tmp / f"{name}.yaml"
    doc = {"name": name, "train": {**FAST, **(train or {})}}
    if checkpoint:
        doc["checkpoint"] = checkpoint
    path.write_text(yaml.safe_dump(doc))
    return path


def launch_env(job: Path, nproc: int = 2, port: int | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "DDPKIT_"))}
    env.update({
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "DDPKIT_JOB_FILE": str(job),
        "DDPKIT_NPROC_PER_NODE": str(nproc),
        "DDPKIT_MASTER_PORT": str(port or free_port()),
    })
    env.update(extra)
    return env


def start(job: Path, cwd: Path, nproc: int = 2, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=cwd,
                            env=launch_env(job, nproc, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run(job: Path, cwd: Path, nproc: int = 2, timeout: float = 240, **extra: str) -> subprocess.CompletedProcess:
    proc = start(job, cwd, nproc, **extra)
    out, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir) if "loss" in r and not r.get("summary")]


def summary(run_dir: Path) -> dict:
    last = records(run_dir)[-1]
    assert last.get("summary"), f"last record of {run_dir}/metrics.jsonl is not a summary: {last}"
    return last


def stop_after_steps(proc: subprocess.Popen, run_dir: Path, steps: int, signum: int) -> str:
    """Wait until `run_dir` logged `steps` training steps, send `signum`, return the output."""
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(step_losses(run_dir)) >= steps, 180,
                 f"{steps} training steps")
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return out


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
