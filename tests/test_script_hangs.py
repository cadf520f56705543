"""The hang watchdog on your own script (trainer/script_watch.py), real processes: a plain DDP
script (tests/stuck_script.py) whose rank 1 sleeps in its own code while rank 0 waits in a
collective, run by the launcher every target runs (`python -m trainer.launch`, torchrun, the
guard), with the process group's timeout left at torch's default (30 min for gloo)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import time

import pytest
import yaml

from tests.test_why import timed_why
from tests.trainer_util import REPO, run, start

pytestmark = pytest.mark.slow


def sleep_line(where: str) -> int:
    """The line of stuck_script.py's sleep `where` (its comment says where)."""
    lines = (REPO / "tests" / "stuck_script.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "time.sleep(3600)" in line and where in line)


def run_stuck(tmp_path, name: str, hang_step: int, **train) -> tuple[str, float]:
    shutil.copy(REPO / "tests" / "stuck_script.py", tmp_path / "stuck.py")
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "script": "stuck.py", "train": train}))
    started = time.monotonic()
    out = run(job, tmp_path, nproc=2, timeout=300, HANG_STEP=str(hang_step)).stdout
    return out, time.monotonic() - started


def verdict(tmp_path, name: str) -> dict:
    text = (tmp_path / "runs" / name / "debug" / "attempt-0" / "verdict.txt").read_text()
    return json.loads(text[:text.rindex("}") + 1])


def test_a_rank_stuck_after_its_steps_is_named_with_its_line_within_the_step_deadline(tmp_path):
    """Steps seen: the deadline is max(hang_floor_s, 10 x p99 step), not the collective timeout."""
    out, took = run_stuck(tmp_path, "stuck-steps", 8, hang_floor_s=3)
    print(f"stuck at step 8 -> run ended after {took:.0f}s (launch included)")
    found = verdict(tmp_path, "stuck-steps")
    assert found["cause"] == "stuck-outside-collective" and found["culprits"] == [1], found
    host = socket.gethostname()
    assert f"rank 1 on {host} in script at step 7" in found["explain"], found
    line = sleep_line("in a step")
    assert f"stuck.py:{line} in main (outside any collective)" in found["explain"], found
    assert "rank 0 in collective at step 7" in found["others"], found
    debug = tmp_path / "runs" / "stuck-steps" / "debug" / "attempt-0"
    assert f'stuck.py", line {line} in main' in (debug / "rank-1.txt").read_text()
    assert "torch/autograd" in (debug / "rank-0.txt").read_text()  # waiting in backward's all-reduce
    assert "exit 124" in out
    lines, _ = timed_why(tmp_path / "runs" / "stuck-steps")
    assert lines[0].startswith("hang: ") and f"stuck.py:{line} in main" in lines[0], lines


def test_a_rank_stuck_before_any_step_is_found_before_the_collective_timeout(tmp_path):
    """No step seen: the ranks waiting in a collective give it max(hang_floor_s, timeout_s / 2)."""
    out, took = run_stuck(tmp_path, "stuck-setup", 0, hang_floor_s=3, timeout_s=10)
    print(f"stuck before any step -> run ended after {took:.0f}s (launch included)")
    found = verdict(tmp_path, "stuck-setup")
    assert found["culprits"] == [1], found
    assert f"stuck.py:{sleep_line('before')} in main (outside any collective)" in found["explain"], found
    assert "rank 0 in collective at step 0" in found["others"], found


def test_a_stop_of_a_hung_script_with_its_own_sigterm_handler_ends_in_seconds_with_every_ranks_stacks(tmp_path):
    """tests/hang_script.py with its own SIGTERM handler: rank 1 asleep in its code, rank 0
    blocked in an all-reduce (its handler can never run), the collective timeout 600 s. SIGTERM
    to the launcher: the ranks get it (stacks written first, then their handler), and the
    launcher ends them SCRIPT_STOP_S later, not after the stop grace (DDPKIT_STOP_GRACE_S 120)."""
    shutil.copy(REPO / "tests" / "hang_script.py", tmp_path / "hang.py")
    job = tmp_path / "stop.yaml"
    job.write_text(yaml.safe_dump({"name": "stop-own-handler", "script": "hang.py"}))
    proc = start(job, tmp_path, 2, TIMEOUT_S="600", OWN_SIGTERM="1", DDPKIT_STOP_GRACE_S="120")
    deadline = time.monotonic() + 120
    while not (tmp_path / "asleep-rank1").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.5)
    time.sleep(2)  # rank 1 asleep, rank 0 in the all-reduce
    stopped = time.monotonic()
    proc.send_signal(15)
    out, _ = proc.communicate(timeout=150)
    print(f"SIGTERM -> launcher exit after {time.monotonic() - stopped:.1f}s (stop grace 120 s)")
    assert proc.returncode == 137, out[-3000:]
    assert "own SIGTERM handler ran" in out  # rank 1's: its sleep returns to Python for it
    assert "writing no checkpoint: ended (SIGKILL)" in out, out[-3000:]
    lines, _ = timed_why(tmp_path / "runs" / "stop-own-handler")
    assert lines[0].startswith("stopped: attempt 0: stopped by a stop signal; where each rank was:"), lines
    assert "(waiting in all_reduce)" in lines[0] and "hang.py:20 in main (outside any collective)" in lines[0], lines


@pytest.mark.parametrize("warm", ["0", "1"])
def test_a_rank_writing_its_checkpoint_at_a_stop_keeps_the_grace_and_the_others_end(tmp_path, warm):
    """tests/save_on_stop_script.py: at SIGTERM rank 1 writes a checkpoint that takes 12 s, rank 0
    is blocked in an all-reduce. SCRIPT_STOP_S after the signal the launcher reads both ranks'
    stacks (py-spy): rank 0 is ended, rank 1 (in torch.save) keeps the stop grace and its file
    loads whole. With warm restarts (`DDPKIT_WARM=1`) the ranks are forked by the node's template
    and torchrun's children are their clients: the stop must read and end the workers."""
    shutil.copy(REPO / "tests" / "save_on_stop_script.py", tmp_path / "save.py")
    job = tmp_path / "save.yaml"
    job.write_text(yaml.safe_dump({"name": "save-on-stop", "script": "save.py"}))
    proc = start(job, tmp_path, 2, DDPKIT_WARM=warm, DDPKIT_STOP_GRACE_S="120")
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-rank{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    time.sleep(1)
    proc.send_signal(15)
    out, _ = proc.communicate(timeout=150)
    spared = re.search(r"rank 1 \(pid (\d+)\) is writing a checkpoint \d+s after the stop: it keeps the stop grace", out)
    assert spared, out[-3000:]
    # torchrun's own log names its children: the workers (cold) or their clients (warm)
    children = set(re.findall(r"Sending process (\d+) closing signal SIGTERM", out))
    assert len(children) == 2 and (spared[1] in children) == (warm == "0"), out[-3000:]
    assert ("ddpkit warm: template" in out) == (warm == "1"), out[-3000:]
    assert "rank(s) 0 still running" in out and "rank 1 saved its checkpoint" in out, out[-3000:]
    import torch

    assert torch.load(tmp_path / "ckpt-rank1.pt", weights_only=False)["weights"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_job_that_needs_longer_to_reach_its_save_point_sets_the_wait(monkeypatch):
    from trainer.launch import script_stop

    assert script_stop.wait_s() == script_stop.SCRIPT_STOP_S
    monkeypatch.setenv("DDPKIT_SCRIPT_STOP_S", "30")
    assert script_stop.wait_s() == 30.0
    monkeypatch.setenv("DDPKIT_SCRIPT_STOP_S", "soon")  # not a number: the default, not a crash
    assert script_stop.wait_s() == script_stop.SCRIPT_STOP_S
