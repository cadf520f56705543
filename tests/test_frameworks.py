"""Your own script on a real framework, unchanged, through `ddpkit run JOB.yaml --local` (the
launcher every target runs: `python -m trainer.launch`, torchrun, `python -m trainer.guard
SCRIPT` per rank): Hugging Face's `transformers.Trainer`, PyTorch Lightning and Accelerate, one
small CPU script of our own each (tests/frameworks/), 2 ranks on gloo.

For each: a run trains every rank together (the same parameters on both) and `status` counts
its optimizer steps, `why` says `completed`; an exception on rank 1 is named with the script's
own line; a rank 1 asleep in its own code is found by the hang watchdog, not by the collective
timeout (30 min for gloo), naming rank 1 and its line.

The frameworks are the `frameworks` optional dependencies (pyproject.toml): off CI a missing
one skips its tests, on CI (`CI=true`) it fails them.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, ddpkit

pytestmark = pytest.mark.slow

SCRIPTS = REPO / "tests" / "frameworks"
#: framework: (script, the module it imports)
FRAMEWORKS = {
    "accelerate": ("accelerate_loop.py", "accelerate"),
    "transformers": ("hf_trainer.py", "transformers"),
    "lightning": ("lightning_fit.py", "pytorch_lightning"),
}
STEPS = 20  # each script's optimizer steps (its STEPS default)


def need(framework: str) -> str:
    """The framework's script; skips without the framework, except on CI, where it fails."""
    script, module = FRAMEWORKS[framework]
    if os.environ.get("CI") == "true":
        importlib.import_module(module)  # CI installs `.[frameworks]`: missing is a failure
    else:
        pytest.importorskip(module, reason=f"{module} is not installed: pip install -e '.[frameworks]'")
    return script


def marked_line(script: str, marker: str) -> int:
    """The line of `script` whose comment is `marker` (`# FAULT=raise`, `# FAULT=hang`)."""
    lines = (SCRIPTS / script).read_text().splitlines()
    [line] = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}")]
    return line


def run_local(tmp_path: Path, name: str, script: str, fault: str = "", timeout: float = 240,
              **top) -> tuple[subprocess.CompletedProcess, float]:
    """`ddpkit run NAME.yaml --local` on a copy of `script` in `tmp_path`; (result, seconds)."""
    shutil.copy(SCRIPTS / script, tmp_path / script)
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "image": "ddpkit:0.1", "procs_per_node": 2,
                                   "script": script, **top}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "FAULT": fault}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "deploy", "run", str(job), "--local"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a stop, as Ctrl-C: the CLI ends its launcher and the ranks
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"{name}: still running after {timeout:.0f}s\n{out[-3000:]}\n{err[-3000:]}")
    took = time.monotonic() - started
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), took


def checksums(text: str) -> dict[int, tuple[int, str]]:
    """rank: (world size, sha256) from the scripts' `rank R/W: params sha256 HEX` lines."""
    return {int(m[1]): (int(m[2]), m[3]) for m in re.finditer(r"rank (\d+)/(\d+): params sha256 ([0-9a-f]{64})", text)}


def why(run_dir: Path) -> list[str]:
    result = ddpkit("why", str(run_dir))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_script_trains_every_rank_together_and_its_steps_are_counted(tmp_path, framework):
    script = need(framework)
    result, took = run_local(tmp_path, "fw", script, steps=STEPS)
    print(f"{framework}: {STEPS} steps, 2 ranks: run took {took:.1f}s (launch included)")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sums = checksums(result.stdout)
    assert sorted(sums) == [0, 1], result.stdout[-3000:]
    assert sums[0] == sums[1] and sums[0][0] == 2, sums  # one world of 2, the same parameters
    run_dir = tmp_path / "runs" / "fw"
    status = ddpkit("status", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    record = json.loads(status.stdout)["progress"]
    assert (record["state"], record["step"], record["total_steps"]) == ("completed", STEPS, STEPS), record
    lines = why(run_dir)
    assert lines[0] == f"completed: attempt 0: step {STEPS}/{STEPS}", lines
    # the script's output is kept in the run directory, each line tagged with its node and the
    # rank that printed it (trainer/rank_lines.py), as the trainer's are (deploy/run/local.py)
    kept = ddpkit("logs", str(run_dir), "--all", "--grep", "params sha256")
    assert kept.returncode == 0, kept.stderr
    printed = [line for line in result.stdout.splitlines() if "params sha256" in line]
    assert sorted(printed) == sorted(f"[rank{r}]: rank {r}/2: params sha256 {sums[r][1]}" for r in (0, 1))
    assert sorted(kept.stdout.splitlines()) == sorted(f"[0/{line[5]}] {line}" for line in printed), kept.stdout
    rank_1 = ddpkit("logs", str(run_dir), "--worker-rank", "1", "--grep", "params sha256")
    assert rank_1.stdout.splitlines() == [line for line in printed if line.startswith("[rank1]: ")], rank_1.stdout


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_exception_on_rank_1_is_named_with_the_scripts_own_line(tmp_path, framework):
    script = need(framework)
    result, took = run_local(tmp_path, "fw-raise", script, fault="raise")
    print(f"{framework}: rank 1 raised at step 3: run took {took:.1f}s")
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = why(tmp_path / "runs" / "fw-raise")
    assert lines[0].startswith("exception: rank 1 ") and "RuntimeError: " in lines[0], lines
    assert f"{script}:{marked_line(script, 'FAULT=raise')} in " in lines[0], lines


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_rank_asleep_in_its_own_code_is_found_by_the_watchdog_with_its_line(tmp_path, framework):
    script = need(framework)
    result, took = run_local(tmp_path, "fw-hang", script, fault="hang", timeout=180, train={"hang_floor_s": 3})
    print(f"{framework}: rank 1 asleep at step 8: run ended after {took:.1f}s (the collective timeout: 30 min)")
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = marked_line(script, "FAULT=hang")
    debug = tmp_path / "runs" / "fw-hang" / "debug" / "attempt-0"
    text = (debug / "verdict.txt").read_text()
    found = json.loads(text[:text.rindex("}") + 1])
    assert found["cause"] == "stuck-outside-collective" and found["culprits"] == [1], found
    assert f"{script}:{line} in " in found["explain"] and "(outside any collective)" in found["explain"], found
    assert found["others"].startswith("rank 0 in collective at step 7"), found
    lines = why(tmp_path / "runs" / "fw-hang")
    assert lines[0].startswith("hang: rank 1 ") and f"{script}:{line} in " in lines[0], lines


@pytest.mark.parametrize("framework", ["lightning"])
def test_ctrl_c_on_a_hung_framework_job_ends_in_seconds_with_every_ranks_place(tmp_path, framework):
    """Lightning installs its own SIGTERM handler; rank 1 asleep in training_step, rank 0 blocked
    in DDP's all-reduce (its handler cannot run), the watchdog off (so only the stop ends it):
    Ctrl-C (SIGINT to `ddpkit run`) ends the job in seconds, not after the stop grace (120 s),
    and `why` says where each rank was."""
    script = need(framework)
    shutil.copy(SCRIPTS / script, tmp_path / script)
    job = tmp_path / "fw-stop.yaml"
    job.write_text(yaml.safe_dump({"name": "fw-stop", "image": "ddpkit:0.1", "procs_per_node": 2, "script": script,
                                   "steps": STEPS, "train": {"watchdog": False}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "FAULT": "hang"}
    proc = subprocess.Popen([sys.executable, "-m", "deploy", "run", str(job), "--local"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "runs" / "fw-stop"
    deadline = time.monotonic() + 180
    while True:  # until rank 0 has done step 7 (rank 1 sleeps at step 8)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        status = ddpkit("status", str(run_dir), "--json")
        if status.returncode == 0 and (json.loads(status.stdout).get("progress") or {}).get("step", 0) >= 7:
            break
        time.sleep(0.5)
    time.sleep(2)
    stopped = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=150)
    print(f"{framework}: Ctrl-C on a hang -> exit after {time.monotonic() - stopped:.1f}s (stop grace 120 s)")
    assert proc.returncode != 0, out[-3000:]
    lines = why(run_dir)
    assert lines[0].startswith("stopped: attempt 0: stopped by a stop signal; where each rank was:"), lines
    assert "rank 1: on " in lines[0] and f"{script}:{marked_line(script, 'FAULT=hang')} in " in lines[0], lines
    assert "rank 0: on " in lines[0] and "(waiting in " in lines[0], lines
