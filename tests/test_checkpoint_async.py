"""`checkpoint.async_save` (background checkpoint writes, crash safety, exact resume) and `train.ddp_comm_hook`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.trainer_util import REPO, records, run, start, step_losses, summary, wait_for, write_job
from trainer import checkpoint

# A child process that saves step 1 synchronously, then step 2 in the background with a writer
# slowed down by 2 s, then does what argv[2] says while that write is in flight.
CHILD = textwrap.dedent("""
    import os, signal, sys, time, torch
    from trainer import checkpoint
    d, action = sys.argv[1], sys.argv[2]
    real_save = checkpoint.save
    checkpoint.save(d, 1, {"w": torch.ones(4)}, keep=3)
    def slow_save(*args, **kwargs):
        time.sleep(2)
        return real_save(*args, **kwargs)
    checkpoint.save = slow_save
    saver = checkpoint.AsyncSaver()
    state = {"w": torch.full((4,), 2.0), "opt": {"state": {0: {"m": torch.zeros(3)}}, "lr": [0.1]}}
    saver.submit(d, 2, state, keep=3)
    state["w"].fill_(99.0)  # training goes on and changes the live tensors
    print("submitted", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)  # "exit": return from main with the save in flight
""")


def child(tmp_path: Path, action: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ck"), action], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_process_that_exits_with_a_save_in_flight_completes_it(tmp_path):
    result = child(tmp_path, "exit")
    assert result.returncode == 0 and "submitted" in result.stdout, result.stderr
    assert checkpoint.newest_valid(tmp_path / "ck").name == "ckpt-000000002.pt"
    state = checkpoint.load(tmp_path / "ck" / "ckpt-000000002.pt")
    # The copy taken at submit time, not the tensor as changed afterwards.
    assert torch.equal(state["w"], torch.full((4,), 2.0))
    assert torch.equal(state["opt"]["state"][0]["m"], torch.zeros(3)) and state["opt"]["lr"] == [0.1]


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    result = child(tmp_path, "kill")
    assert result.returncode == -signal.SIGKILL and "submitted" in result.stdout, result.stderr
    assert [s for s, _ in checkpoint.checkpoints(tmp_path / "ck")] == [1]
    assert checkpoint.newest_valid(tmp_path / "ck").name == "ckpt-000000001.pt"


def test_a_failed_background_write_is_raised_by_the_next_wait(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    saver = checkpoint.AsyncSaver()
    saver.submit(blocker / "ck", 1, {"w": torch.ones(2)}, keep=1)
    with pytest.raises(RuntimeError, match="background checkpoint write failed"):
        saver.wait()
    saver.wait()  # reported once


def test_host_buffers_are_reused_and_state_dict_metadata_kept(tmp_path):
    model = torch.nn.BatchNorm1d(3)
    saver = checkpoint.AsyncSaver()
    saver.submit(tmp_path, 1, {"model": model.state_dict()}, keep=2)
    buffers = {k: v.data_ptr() for k, v in saver.buffers.items()}
    saver.submit(tmp_path, 2, {"model": model.state_dict()}, keep=2)
    saver.wait()
    assert {k: v.data_ptr() for k, v in saver.buffers.items()} == buffers
    loaded = checkpoint.load(tmp_path / "ckpt-000000002.pt")["model"]
    assert loaded._metadata == model.state_dict()._metadata
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow
def test_async_save_resumes_bit_exact_after_a_stop_and_after_kill_9(tmp_path):
    """2 ranks, gloo: an uninterrupted run with synchronous saves, and runs with background
    saves that are (a) stopped by a request and resumed, (b) killed with SIGKILL (every process
    at once, a write possibly in flight) and resumed: the same final parameters, bit for bit."""
    train = {"max_steps": 30, "epochs": 2, "data_samples": 2048}
    whole = run(write_job(tmp_path, "whole", train, {"every_steps": 4}), tmp_path)
    assert whole.returncode == 0, whole.stdout[-3000:]
    reference = summary(tmp_path / "runs" / "whole")

    job = write_job(tmp_path, "stop", train, {"every_steps": 4, "async_save": True})
    first = run(job, tmp_path, DDPKIT_STOP_AT_STEP="13")
    assert first.returncode == 143, first.stdout[-3000:]
    assert "writing it in the background" in first.stdout
    events = [r for r in records(tmp_path / "runs" / "stop") if r.get("event") == "checkpoint"]
    assert [e["background"] for e in events] == [True, True, True, False], events  # 4, 8, 12; the stop
    stopped = summary(tmp_path / "runs" / "stop")["steps"]  # the ranks agree one step after the request
    second = run(job, tmp_path)
    assert second.returncode == 0, second.stdout[-3000:]
    s = summary(tmp_path / "runs" / "stop")
    assert s["resumed_from_step"] == stopped and s["final_params_sha256"] == reference["final_params_sha256"] is not None

    job = write_job(tmp_path, "kill", {**train, "log_every_steps": 1}, {"every_steps": 4, "async_save": True})
    run_dir = tmp_path / "runs" / "kill"
    proc = start(job, tmp_path)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(step_losses(run_dir)) >= 17, 180, "17 steps")
        for pid in [proc.pid, *_descendants(proc.pid)]:  # all at once: nobody gets to clean up
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    time.sleep(0.5)
    saved = [s for s, _ in checkpoint.checkpoints(run_dir / "checkpoints")]
    assert saved and max(saved) >= 12 and not (run_dir / "checkpoints" / "FINISHED").exists(), saved
    again = run(job, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:]
    s = summary(run_dir)
    assert s["resumed_from_step"] == max(saved) and s["steps"] == 30
    assert s["final_params_sha256"] == reference["final_params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("static_graph", [True, False])
def test_a_resumed_run_of_3_ranks_ends_bit_exact_as_ddp_rebuilt_its_buckets_first(tmp_path, static_graph):
    """3 ranks: DDP sums a rank's gradients in an order set by its bucket layout, which it
    rebuilds after the first backward (the second with static_graph), so without
    `settle_buckets` the first steps after a resume summed differently from the uninterrupted
    run's and the final parameters differed in their last bits (2 ranks cannot show it)."""
    train = {"max_steps": 12, "epochs": 2, "data_samples": 2048, "static_graph": static_graph}
    whole = run(write_job(tmp_path, "whole", train, {"every_steps": 4}), tmp_path, nproc=3)
    assert whole.returncode == 0, whole.stdout[-3000:]
    job = write_job(tmp_path, "stop", train, {"every_steps": 4})
    first = run(job, tmp_path, nproc=3, DDPKIT_STOP_AT_STEP="5")
    assert first.returncode == 143, first.stdout[-3000:]
    second = run(job, tmp_path, nproc=3)
    assert second.returncode == 0, second.stdout[-3000:]
    reference, resumed = summary(tmp_path / "runs" / "whole"), summary(tmp_path / "runs" / "stop")
    assert resumed["resumed_from_step"] == 6, resumed  # the ranks agree one step after the request
    assert resumed["final_params_sha256"] == reference["final_params_sha256"] is not None


def test_the_fp16_gradient_compression_hook_is_used_and_trains_like_fp32(tmp_path):
    """2 ranks with `ddp_comm_hook: fp16` against the same run without: the per-step losses
    differ (the gradients really went through fp16) but stay within 1% (it trains the same)."""
    losses = {}
    for hook in ("none", "fp16"):
        result = run(write_job(tmp_path, hook, {"max_steps": 8, "data_samples": 2048, "ddp_comm_hook": hook}), tmp_path)
        assert result.returncode == 0, result.stdout[-3000:]
        s = summary(tmp_path / "runs" / hook)
        assert s["steps"] == 8 and s["world_size"] == 2 and s["params_identical"], s
        losses[hook] = step_losses(tmp_path / "runs" / hook)
    assert losses["fp16"] != losses["none"]
    assert losses["fp16"] == pytest.approx(losses["none"], rel=1e-2)
