"""Faults with real processes (CPU, gloo): killed ranks, cut-off checkpoints, stop signals.

Each test starts the real entry points (`ddpkit run --local`, `python -m trainer.launch`,
torchrun, `trainer.train`) and injects the fault from outside: SIGKILL to one worker process,
SIGTERM to every rank, damaged files in the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_util import (
    REPO,
    free_port,
    launch_env,
    records,
    run,
    start,
    summary,
    wait_for,
    write_job,
)
from trainer import checkpoint

pytestmark = pytest.mark.slow


def worker_pids(run_id: str, under: int) -> dict[int, int]:
    """{rank: pid} of the live processes that compute the ranks of run `run_id` below process
    `under`: on the warm path (trainer/warm.py) the workers the template forked, named
    `ddpkit-rank<R>` (the `trainer.warm` clients torchrun started only stand in for them: a
    SIGSTOP or a CPU quota on a client does nothing to the rank), else the `trainer.train`
    processes whose DDPKIT_RUN_ID is `run_id`. Only below `under`: other sessions on a shared
    machine run these same tests, with the same run ids, at the same time (a kill of their rank
    is a flake in both runs: theirs dies, ours never restarts)."""
    found: dict[int, int] = {}
    forked: dict[int, int] = {}
    for pid in map(str, descendants(under)):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm.startswith("ddpkit-rank") and comm[len("ddpkit-rank"):].isdigit():
                forked[int(comm[len("ddpkit-rank"):])] = int(pid)
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"trainer.train" not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"DDPKIT_RUN_ID") == run_id.encode() and b"RANK" in env and b"DDPKIT_WARM_SOCKET" not in env:
            found[int(env[b"RANK"])] = int(pid)
    return forked or found


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def logged_steps(run_dir: Path) -> list[int]:
    try:
        return [r["step"] for r in records(run_dir) if "loss" in r and not r.get("summary")]
    except (OSError, ValueError):  # not there yet, or a line half-written
        return []


def forked_worker(rank: int, under: int) -> int | None:
    """The pid of rank `rank`'s worker forked by the warm path's template below process `under`
    (trainer/warm.py names it `ddpkit-rank<R>`); None while there is none."""
    for pid in descendants(under):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"ddpkit-rank{rank}":
                return pid
    return None


def ddpkit_run(job: Path, cwd: Path, *sets: str, **extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "deploy", "run", str(job), "--local", *(a for s in sets for a in ("--set", s))]
    env = {**launch_env(job, **extra), "PYTHONPATH": str(REPO)}
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
    with the uninterrupted run's parameters; at most one checkpoint interval is lost. The killed
    run takes the warm path (the default: its workers are forked from the node's template,
    trainer/warm.py, and the restart is forked from the same template, without importing torch
    again), the uninterrupted one the cold path (`DDPKIT_WARM=0`): the two end bit for bit equal."""
    train = {"max_steps": 60, "epochs": 2, "data_samples": 4096, "lr": 0.05, "momentum": 0.9}
    every = 10
    # The time limits only bound a hang: at load 25 on 2 cores a start alone takes a minute.
    whole = ddpkit_run(write_ddpkit_job(tmp_path, "whole", train, every, 0), tmp_path, DDPKIT_WARM="0")
    out, _ = whole.communicate(timeout=600)
    assert whole.returncode == 0, out[-3000:]

    job = write_ddpkit_job(tmp_path, "killed", train, every, 1)
    run_dir = tmp_path / "runs" / "killed"
    proc = ddpkit_run(job, tmp_path)
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 25, 480, "25 training steps")
        wait_for(lambda: forked_worker(1, proc.pid), 60, "rank 1's forked worker")
        os.kill(forked_worker(1, proc.pid), signal.SIGKILL)  # the process that computes rank 1
        out, _ = proc.communicate(timeout=600)
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
    # Warm, both attempts from one template: the one the node's launcher started.
    starts = [json.loads(p.read_text())["start"] for p in sorted((run_dir / "attempts").glob("attempt-*.json"))]
    [launch] = [json.loads(p.read_text()) for p in (run_dir / "attempts" / "launch").glob("*.json")]
    assert starts == [{"warm": True, "template_pid": launch["template_pid"]}] * 2, (starts, launch)
    assert "forked" in b["launch_marks"]
    whole_starts = [json.loads(p.read_text())["start"] for p in (tmp_path / "runs" / "whole" / "attempts").glob("attempt-*.json")]
    assert whole_starts == [{"warm": False}]


# -- checkpoints cut off mid-save, damaged checkpoints ---------------------------------------
TRAIN = {"max_steps": 30, "epochs": 2, "data_samples": 2048}  # 16 steps per epoch
CKPT = {"every_steps": 10, "keep": 3}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("whole")
    result = run(write_job(tmp, "whole", TRAIN, CKPT), tmp)
    assert result.returncode == 0, result.stdout[-3000:]
    return summary(tmp / "runs" / "whole")


@pytest.mark.parametrize("point", ["before-publish", "mid-publish"])
def test_a_crash_while_publishing_a_checkpoint_keeps_the_previous_one(tmp_path, uninterrupted, point):
    """SIGKILL of the saving rank after the files are written but before they are published,
    and between the two renames: the previous checkpoint is intact and the rerun resumes from
    it to the uninterrupted run's parameters."""
    job = write_job(tmp_path, "cut", TRAIN, CKPT)
    ckpt_dir = tmp_path / "runs" / "cut" / "checkpoints"
    first = run(job, tmp_path, DDPKIT_FAULT_CRASH=f"20:{point}")
    assert first.returncode != 0 and f"killing this process at {point}" in first.stdout, first.stdout[-3000:]
    assert [s for s, _ in checkpoint.checkpoints(ckpt_dir)] == [10]
    assert checkpoint.verify(ckpt_dir / "ckpt-000000010.pt") is None
    assert checkpoint.newest_valid(ckpt_dir) == ckpt_dir / "ckpt-000000010.pt"
    leftovers = sorted(p.name for p in ckpt_dir.iterdir() if "000000020" in p.name)
    assert leftovers, "the crash happened after the new files were written"

    second = run(job, tmp_path)
    assert second.returncode == 0, second.stdout[-3000:]
    s = summary(tmp_path / "runs" / "cut")
    assert s["resumed_from_step"] == 10 and s["steps"] == 30
    assert s["final_params_sha256"] == uninterrupted["final_params_sha256"] is not None
    assert not [p.name for p in ckpt_dir.iterdir() if ".tmp-" in p.name]  # the next save cleaned up


def test_a_corrupted_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, uninterrupted):
    job = write_job(tmp_path, "flip", TRAIN, CKPT)
    ckpt_dir = tmp_path / "runs" / "flip" / "checkpoints"
    first = run(job, tmp_path, DDPKIT_STOP_AT_STEP="25")
    assert first.returncode == 143, first.stdout[-3000:]
    assert [s for s, _ in checkpoint.checkpoints(ckpt_dir)] == [26, 20, 10]
    newest = ckpt_dir / "ckpt-000000026.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the middle: torch.load would not notice
    newest.write_bytes(bytes(data))

    second = run(job, tmp_path)
    assert second.returncode == 0, second.stdout[-3000:]
    warning = [line for line in second.stdout.splitlines() if "is unusable" in line]
    assert len(warning) == 1 and str(newest.relative_to(tmp_path)) in warning[0], second.stdout[-3000:]
    assert "checksum mismatch" in warning[0] and "trying the previous one" in warning[0]
    s = summary(tmp_path / "runs" / "flip")
    assert s["resumed_from_step"] == 20 and s["final_params_sha256"] == uninterrupted["final_params_sha256"]


# -- SIGTERM to every process (Kubernetes eviction, Slurm time limit) -------------------------
def sigterm_everything(proc: subprocess.Popen, run_dir: Path, steps: int) -> str:
    """After `steps` logged steps, SIGTERM the launcher, torchrun and every worker at once."""
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= steps, 180, f"{steps} training steps")
        for pid in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    return out


def test_sigterm_to_every_rank_waits_for_a_slow_checkpoint_and_exits_143(tmp_path):
    """A stop checkpoint that takes longer than torchrun's default 30 s shutdown timeout but
    less than the grace period is written, and the node exits 143 (retryable)."""
    job = write_job(tmp_path, "slow", {"max_steps": 500, "epochs": 50, "data_samples": 1024},
                    {"every_steps": 100000})
    run_dir = tmp_path / "runs" / "slow"
    proc = start(job, tmp_path, DDPKIT_STOP_GRACE_S="90", DDPKIT_FAULT_SAVE_DELAY_S="35")
    out = sigterm_everything(proc, run_dir, 3)
    assert proc.returncode == 143, out[-3000:]
    s = summary(run_dir)
    assert s["status"] == "stopped" and f"stopped after the checkpoint of step {s['steps']}: exit 143" in out
    assert [step for step, _ in checkpoint.checkpoints(run_dir / "checkpoints")] == [s["steps"]]
    assert "forcefully exiting" not in out


def test_sigterm_without_time_to_checkpoint_exits_137_not_143(tmp_path):
    """The grace period ends before the checkpoint is written: torchrun kills the workers, and
    the exit code says nothing was saved (137, still retryable) instead of 143."""
    job = write_job(tmp_path, "short", {"max_steps": 500, "epochs": 50, "data_samples": 1024},
                    {"every_steps": 100000})
    run_dir = tmp_path / "runs" / "short"
    proc = start(job, tmp_path, DDPKIT_STOP_GRACE_S="3", DDPKIT_FAULT_SAVE_DELAY_S="60")
    out = sigterm_everything(proc, run_dir, 3)
    assert proc.returncode == 137, out[-3000:]
    assert "before a checkpoint was written" in out and "exit 137" in out
    assert checkpoint.checkpoints(run_dir / "checkpoints") == []


# -- resume with another world size ------------------------------------------------------------
def resizable_job(tmp_path: Path, name: str, dropout: float) -> tuple[Path, Path]:
    """One epoch of 512 samples, 2 ranks x 16 a step (global batch 32, 16 steps), a checkpoint
    every 3 steps; every fetched sample id recorded under `ids/<name>`."""
    ids = tmp_path / "ids" / name
    ids.mkdir(parents=True)
    job = write_job(tmp_path, name, {"model": "tests.user_workloads:recorded", "batch_size": 16, "epochs": 1,
                                     "lr": 0.1, "model_args": {"samples": 512, "ids_dir": str(ids), "dropout": dropout}},
                    {"every_steps": 3})
    return job, ids


def sample_ids(ids: Path) -> list[int]:
    return [int(i) for f in sorted(ids.iterdir()) for line in f.read_text().splitlines() for i in line.split()]


def final_model(tmp_path: Path, name: str) -> dict:
    step, path = checkpoint.checkpoints(tmp_path / "runs" / name / "checkpoints")[0]
    assert step == 16
    return checkpoint.load(path)["model"]


def resize_run(tmp_path: Path, name: str, dropout: float, sizes: list[int]) -> tuple[list[int], dict, list[str]]:
    """Run `name` on each rank count of `sizes` in turn, every attempt but the last stopped
    after a few steps: (the sample ids trained on, the final weights, each attempt's output)."""
    job, ids = resizable_job(tmp_path, name, dropout)
    outs = []
    for i, nproc in enumerate(sizes):
        last = i == len(sizes) - 1
        proc = run(job, tmp_path, nproc=nproc, **({} if last else {"DDPKIT_STOP_AT_STEP": str(4 + 5 * i)}))
        assert proc.returncode == (0 if last else 143), proc.stdout[-3000:]
        outs.append(proc.stdout)
    return sample_ids(ids), final_model(tmp_path, name), outs


def test_2_to_1_to_2_ranks_mid_epoch_trains_every_sample_once_and_ends_bit_for_bit(tmp_path):
    """Stopped mid-epoch at 2 ranks, resumed at 1, stopped, resumed at 2: the global batch (32)
    is kept (1 rank: 16 x grad_accum 2), every sample of the epoch is trained on exactly once
    across the three attempts, and the final weights are the uninterrupted 2-rank run's bit for
    bit: the micro-batches are the same chunks of 16, and the model's dropout draws the same
    masks (random draws are seeded per chunk, not per rank)."""
    import torch

    ref_ids, ref_model, _ = resize_run(tmp_path, "whole", 0.3, [2])
    assert sorted(ref_ids) == list(range(512))
    ids, model, outs = resize_run(tmp_path, "shrink", 0.3, [2, 1, 2])
    assert sorted(ids) == list(range(512))  # each sample exactly once, across three attempts
    assert "this run keeps its global batch of 32 samples as 1 ranks x 16 x grad_accum 2" in outs[1]
    assert "this run keeps its global batch of 32 samples as 2 ranks x 16 x grad_accum 1" in outs[2]
    for k in ref_model:
        assert torch.equal(model[k], ref_model[k]), k


def test_2_to_4_ranks_mid_epoch_trains_every_sample_once_and_ends_within_tolerance(tmp_path):
    """Stopped mid-epoch at 2 ranks x 16, resumed at 4: the global batch is kept as 4 x 8 (the
    micro-batch halves: `batch_size` is a memory limit, never exceeded), every sample trained
    on once, the final weights those of the uninterrupted run to float tolerance (a mean of 8
    then of 4 rounds differently from a mean of 16 then of 2). No dropout: finer chunks draw
    other masks."""
    import torch

    _, ref_model, _ = resize_run(tmp_path, "whole", 0.0, [2])
    ids, model, outs = resize_run(tmp_path, "grow", 0.0, [2, 4])
    assert sorted(ids) == list(range(512))
    assert "this run keeps its global batch of 32 samples as 4 ranks x 8 x grad_accum 1" in outs[1]
    assert any(not torch.equal(model[k], ref_model[k]) for k in ref_model)  # another rounding...
    for k in ref_model:  # ...of the same training
        torch.testing.assert_close(model[k], ref_model[k], rtol=1e-5, atol=1e-6)


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused_with_the_reason(tmp_path):
    """2 ranks x 64 checkpoint; 3 ranks cannot train 128 samples a step evenly: the trainer
    refuses on every rank with one line that names the rank counts that can, trains nothing."""
    job = write_job(tmp_path, "resize", {"max_steps": 20, "epochs": 2, "data_samples": 2048}, {"every_steps": 5})
    first = run(job, tmp_path, DDPKIT_STOP_AT_STEP="6")
    assert first.returncode == 143, first.stdout[-3000:]
    run_dir = tmp_path / "runs" / "resize"
    n = len(records(run_dir))

    bigger = run(job, tmp_path, nproc=3)
    assert bigger.returncode != 0, bigger.stdout[-3000:]
    why = [line for line in bigger.stdout.splitlines() if line.startswith("ddpkit: checkpoint ")]
    assert len(why) == 3, bigger.stdout[-3000:]  # one line per rank, no traceback
    assert "ckpt-000000007.pt (step 7) was written by 2 ranks, this run has 3" in why[0]
    assert "a global batch of 128 samples does not split evenly over 3 ranks" in why[0]
    assert "run with 2 ranks (or any of 1, 2, 4, 8, 16, 32, 64)" in why[0]
    assert f'File "{REPO / "trainer"}' not in bigger.stdout  # no trainer traceback (torchrun prints its own)
    assert len(records(run_dir)) == n  # nothing trained, nothing appended

    same = run(job, tmp_path)  # the original world size resumes as before
    assert same.returncode == 0 and summary(run_dir)["resumed_from_step"] == 7


# -- elastic: a lost node, then a new one ------------------------------------------------------
def start_node(job: Path, cwd: Path, index: int, port: int, out: Path, nnodes: str = "1:2",
               restarts: int = 3) -> subprocess.Popen:
    """One 'node' of a job on this machine (elastic by default): a launcher with `--nnodes
    NNODES` and one rank, as an Indexed Job's pod starts it (node 0 hosts the rendezvous store)."""
    env = launch_env(job, nproc=1, port=port, JOB_COMPLETION_INDEX=str(index), DDPKIT_NNODES=nnodes,
                     DDPKIT_MASTER_ADDR="127.0.0.1", DDPKIT_MAX_RESTARTS=str(restarts), DDPKIT_RUN_ID=job.stem)
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=cwd, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def test_an_elastic_group_that_loses_a_node_carries_on_smaller_and_grows_back(tmp_path):
    """Two nodes of one rank each, `nodes: 1:2`. Node 1 dies whole (launcher, torchrun and
    worker: SIGKILL): node 0's worker fails, torchrun restarts it, the rendezvous closes with
    one node after its last call (5 s) and training resumes from the newest checkpoint on 1
    rank, keeping the global batch (16 x grad_accum 2), without waiting for a replacement. A
    new node 1 then joins: the group stops with a checkpoint, re-forms at 2 ranks and finishes.
    The final weights are an uninterrupted 2-rank run's, bit for bit (the same chunks at 1 and
    2 ranks; the steps redone after the kill recomputed exactly)."""
    import time

    import torch

    train = {"batch_size": 16, "data_samples": 2048, "epochs": 20, "log_every_steps": 5}
    ref = run(write_job(tmp_path, "steady", train, {"every_steps": 20}), tmp_path)
    assert ref.returncode == 0, ref.stdout[-3000:]
    job, port = write_job(tmp_path, "elastic", train, {"every_steps": 20}), free_port()
    run_dir, logs = tmp_path / "runs" / "elastic", [tmp_path / f"node{i}.log" for i in (0, 1, 2)]
    node0, node1 = (start_node(job, tmp_path, i, port, logs[i]) for i in (0, 1))
    try:
        wait_for(lambda: len(logged_steps(run_dir)) > 40, 240, "40 steps at 2 ranks")
        for pid in descendants(node1.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node1.wait()
        t_kill = time.time()
        smaller = "keeps its global batch of 32 samples as 1 ranks x 16 x grad_accum 2"
        wait_for(lambda: smaller in logs[0].read_text(), 180, "node 0 resuming alone")
        t_resumed = time.time()
        node1 = start_node(job, tmp_path, 1, port, logs[2])
        assert node0.wait(timeout=400) == 0, logs[0].read_text()[-3000:]
        assert node1.wait(timeout=60) == 0, logs[2].read_text()[-3000:]
    finally:
        for p in (node0, node1):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    out = logs[0].read_text()
    assert "keeps its global batch of 32 samples as 2 ranks x 16 x grad_accum 1" in out.split(smaller)[1]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["steps"] == 1280
    print(f"node lost -> resumed alone: {t_resumed - t_kill:.1f} s")
    final = {name: checkpoint.load(checkpoint.checkpoints(tmp_path / "runs" / name / "checkpoints")[0][1])["model"]
             for name in ("steady", "elastic")}
    for k in final["steady"]:
        assert torch.equal(final["elastic"][k], final["steady"][k]), k


def test_a_node_whose_store_host_froze_ends_instead_of_waiting_for_good(tmp_path):
    """Two nodes of one rank, `restarts: 0`. Node 0, the rendezvous store's host, freezes whole
    (SIGSTOP to its launcher, torchrun, template and worker: like a node that died with its
    link down, no reset reaches node 1). torch's store client retries an unanswered request
    without end, so node 1 would wait for good; instead its worker's watchdog names the store
    that stopped answering, and its launcher ends torchrun once the rendezvous store does not
    answer either: node 1 exits 1 (CI once saw such a pod stay Running)."""
    import time

    train = {"batch_size": 16, "data_samples": 4096, "epochs": 100, "log_every_steps": 5}
    job, port = write_job(tmp_path, "frozen", train, {"every_steps": 50}), free_port()
    run_dir, logs = tmp_path / "runs" / "frozen", [tmp_path / f"node{i}.log" for i in (0, 1)]
    node0, node1 = (start_node(job, tmp_path, i, port, logs[i], nnodes="2", restarts=0) for i in (0, 1))
    try:
        wait_for(lambda: len(logged_steps(run_dir)) > 20, 240, "20 steps at 2 ranks")
        for pid in descendants(node0.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        assert node1.wait(timeout=240) == 1, logs[1].read_text()[-3000:]
        print(f"node 0 frozen -> node 1 ended: {time.monotonic() - frozen:.0f} s")
    finally:  # the descendants first: once a launcher is gone its stopped torchrun is init's child
        for p in (node0, node1):
            for pid in descendants(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    out = logs[1].read_text()
    assert "does not answer (TimeoutError" in out and "node rank 0, its host, is frozen, gone or cut off" in out, out[-3000:]
    assert "its rendezvous store 127.0.0.1:" in out and "ending torchrun: exit 1" in out, out[-3000:]


def test_a_node_lost_before_the_deadlines_are_timed_is_found_by_its_silent_heartbeat(tmp_path):
    """Two nodes of one rank, `restarts: 0`, a step's deadline out of reach (`hang_factor`
    1000, and the collective timeout, 600 s, before 5 timed steps). Node 1 (not the store's
    host) freezes whole in its first steps, as a node that died with its link down: node 0's
    rank waits in the all-reduce and, past `hang_floor_s`, reads that the next rank's heartbeat
    has stopped: the verdict names rank 1 frozen and node 0 ends within a minute, not after
    600 s (CI once saw a Job's pod stay Running past 240 s after its peer's node died early)."""
    import time

    train = {"batch_size": 128, "data_samples": 1 << 16, "epochs": 100, "hang_floor_s": 10, "hang_factor": 1000}
    job, port = write_job(tmp_path, "lost", train, {"every_steps": 1000}), free_port()
    run_dir, logs = tmp_path / "runs" / "lost", [tmp_path / f"node{i}.log" for i in (0, 1)]
    node0, node1 = (start_node(job, tmp_path, i, port, logs[i], nnodes="2", restarts=0) for i in (0, 1))
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 1, 240, "a first step at 2 ranks")
        for pid in descendants(node1.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            assert node0.wait(timeout=120) != 0, logs[0].read_text()[-3000:]
        except subprocess.TimeoutExpired:  # say where node 0 was (CI saw this once, 2026-12-04)
            pytest.fail(f"node 0 still running 120 s after node 1 froze at step {max(logged_steps(run_dir))}; "
                        f"its log:\n{logs[0].read_text()[-4000:]}")
        print(f"node 1 frozen at step {max(logged_steps(run_dir))} -> node 0 ended: {time.monotonic() - frozen:.0f} s")
    finally:
        for p in (node0, node1):
            for pid in descendants(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    out = logs[0].read_text()
    hang = [json.loads(line.split("ddpkit-hang ", 1)[1]) for line in out.splitlines() if "ddpkit-hang {" in line]
    assert hang and hang[0]["cause"] == "frozen" and hang[0]["culprits"] == [1], out[-3000:]
    assert "rank 1 on " in hang[0]["explain"] and "stopped answering" in hang[0]["explain"], hang[0]
