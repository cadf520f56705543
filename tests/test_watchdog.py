"""The hang watchdog (trainer/watchdog.py): its verdict rules and deadlines, then real 2-rank
runs in which one rank stops (asleep in its forward, stuck in a DataLoader worker, SIGSTOPped):
found within 30 s, the culprit named, every live rank's stacks written, the attempt ended and
the restarted group finishing the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from deploy.why import explain
from tests.test_faults import logged_steps, worker_pids
from tests.trainer_util import REPO, launch_env, wait_for
from trainer.watchdog import STALE_S, WARM_STEPS, Heartbeat, verdict


def beat(phase: str, step: int, t: float = 100.0, since: float = 90.0, pid: int = 1) -> dict:
    return {"phase": phase, "step": step, "t": t, "since": since, "host": "elsewhere", "pid": pid}


def test_the_verdict_names_the_rank_that_is_not_where_the_others_wait():
    now = 101.0
    frozen = verdict({0: beat("backward", 7), 1: beat("forward", 7, t=now - STALE_S - 5)}, now, 2)
    assert frozen["cause"] == "frozen" and frozen["culprits"] == [1]
    assert "rank 1 on elsewhere" in frozen["explain"] and frozen["others"] == "rank 0 in backward at step 7"
    outside = verdict({0: beat("backward", 7), 1: beat("data", 7), 2: beat("backward", 7)}, now, 3)
    assert outside["cause"] == "stuck-outside-collective" and outside["culprits"] == [1]
    assert outside["others"] == "ranks 0,2 in backward at step 7"
    branch = verdict({0: beat("vote", 7), 1: beat("backward", 8), 2: beat("vote", 7)}, now, 3)
    assert branch["cause"] == "mismatched-collectives" and branch["culprits"] == [1]
    stuck = verdict({0: beat("backward", 7), 1: beat("backward", 7)}, now, 2)
    assert stuck["cause"] == "deadlock" and stuck["culprits"] == [0, 1]
    missing = verdict({0: beat("backward", 7)}, now, 2)
    assert missing["culprits"] == [1] and "no heartbeat at all" in missing["explain"]


def test_deadlines_follow_the_step_times_after_a_warm_up_and_never_go_below_the_floor():
    hb = Heartbeat()
    hb.beat("forward", 1)
    assert hb.deadline(20, 10, 600) == 600  # no step timed yet: the collective timeout
    hb.step_times.extend([0.1] * WARM_STEPS)
    assert hb.deadline(20, 10, 600) == 20  # 10 x 0.1 s is under the floor
    hb.step_times.extend([5.0] * 50)
    assert hb.deadline(20, 10, 600) == 50  # 10 x the p99
    hb.beat("checkpoint")
    assert hb.deadline(20, 10, 600) == 600  # the first checkpoint of the attempt
    hb.since -= 30  # it took 30 s
    hb.beat("vote")
    hb.beat("checkpoint")
    assert hb.deadline(20, 10, 600) == pytest.approx(300, rel=0.01)


def test_a_rank_that_sees_the_flag_writes_a_late_verdict_to_its_own_nodes_log(tmp_path, monkeypatch, capsys):
    """The reporter posts its verdict after DUMP_WAIT_S and its bookkeeping; a rank of another
    node that saw the flag waits for it (its node's log may be the only one a cluster keeps)
    even when the reporter is slower than twice DUMP_WAIT_S (a loaded node, a pod's CPU quota:
    seen once on the Kubernetes testbed, where `why` then could not name the rank)."""
    from torch.distributed import TCPStore

    from trainer import watchdog

    monkeypatch.setattr(watchdog, "DUMP_WAIT_S", 0.5)
    monkeypatch.setattr(watchdog, "STORE_TIMEOUT_S", 3.0)
    monkeypatch.setattr(watchdog, "leave", lambda: (_ for _ in ()).throw(SystemExit(124)))
    monkeypatch.setenv("LOCAL_RANK", "0")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dog = watchdog.Watchdog(Heartbeat(), rank=1, world=2, attempt=0, debug_dir=tmp_path, floor_s=3,
                            factor=10, timeout_s=600)
    store.set(dog.flag, "1")
    found = {"attempt": 0, "reporter": 0, "host": "elsewhere", "culprits": [1], "explain": "rank 1: asleep"}
    late = threading.Timer(1.5, lambda: store.set(dog.flag + "/verdict", json.dumps(found)))  # > 2 x 0.5 s
    late.start()
    with pytest.raises(SystemExit):
        dog._tick(store)
    late.join()
    relayed = [json.loads(line.split(watchdog.PREFIX, 1)[1]) for line in capsys.readouterr().out.splitlines()
               if line.startswith(watchdog.PREFIX)]
    assert relayed == [found]
    assert (tmp_path / "rank-1.txt").exists()  # its stacks first, as every rank that sees the flag

def start(tmp: Path, name: str, model_args: dict, max_steps: int = 60, **train) -> tuple[subprocess.Popen, Path]:
    """`ddpkit run --local` of 2 ranks of the `hang` workload, restarts=1, a 10 s stop grace (a
    frozen rank is killed by torchrun after it)."""
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump({
        "name": name, "image": "ddpkit:0.1", "procs_per_node": 2, "restarts": 1,
        "checkpoint": {"every_steps": 10, "keep": 2},
        "train": {"model": "tests.user_workloads:hang", "model_args": model_args, "max_steps": max_steps,
                  "epochs": 100, "batch_size": 32, "threads": 1, "eval_every_epochs": 0, "plot": False,
                  "log_every_steps": 1, **train}}))
    env = {**launch_env(job), "PYTHONPATH": str(REPO), "DDPKIT_STOP_GRACE_S": "10"}
    proc = subprocess.Popen([sys.executable, "-m", "deploy", "run", str(job), "--local"], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, tmp / "runs" / name


def hang_verdicts(out: str) -> list[dict]:
    return [json.loads(line.split("ddpkit-hang ", 1)[1]) for line in out.splitlines() if "ddpkit-hang " in line]


def finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    return out


def check_run(out: str, run_dir: Path, cause: str) -> dict:
    """One verdict, naming rank 1 with `cause`; stacks of the live ranks; the restarted group
    completed; the hang booked in the first attempt's ledger. (How soon: a figure of
    bench/fault_corpus.py, not asserted here.)"""
    [found] = hang_verdicts(out)
    print(f"verdict after {found.get('age_s')} s: {found['explain']}")
    assert found["cause"] == cause and found["culprits"] == [1], found
    debug = run_dir / "debug" / "attempt-0"
    assert "Thread" in (debug / "rank-0.txt").read_text()  # faulthandler's dump of every thread
    assert (debug / "verdict.txt").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["summary"] and records[-1]["status"] == "completed", records[-1]
    first = json.loads((run_dir / "attempts" / "attempt-0.json").read_text())
    assert first["state"] == "hung" and first["classes"]["hang"] > 10, first["classes"]
    why = explain("", "", run_dir)  # `ddpkit why RUN_DIR`: completed, after a hang in attempt 0
    assert why[0].startswith("completed: attempt 1") and why[1].startswith("  attempt 0: hang: rank 1"), why
    return found


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "data"])
def test_a_rank_that_stops_working_is_named_and_the_group_restarts(tmp_path, where):
    """Rank 1 asleep outside any collective (in its forward), or stuck in its DataLoader
    worker: rank 0 waits in backward's all-reduce; the watchdog names rank 1 and where."""
    extra = {"num_workers": 1} if where == "data" else {}
    proc, run_dir = start(tmp_path, f"hang-{where}", {"where": where, "after": 25 if where == "forward" else 900,
                                                      "marker": str(tmp_path / "hung-once")}, **extra)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    found = check_run(out, run_dir, "stuck-outside-collective")
    assert f"rank 1 on {os.uname().nodename} in {where}" in found["explain"]
    assert "rank 0 in backward" in found["others"]
    if where == "forward":
        assert "maybe_hang" in (run_dir / "debug" / "attempt-0" / "rank-1.txt").read_text()


@pytest.mark.slow
def test_a_sigstopped_rank_is_named_frozen_with_its_process_state(tmp_path):
    # 3000 steps of a small model: a few seconds of training, so that the heartbeats of both
    # ranks have been published in training when rank 1 is stopped
    proc, run_dir = start(tmp_path, "hang-stop", {"where": "none", "marker": str(tmp_path / "unused")},
                          max_steps=3000)
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 600, 480, "600 training steps")
        wait_for(lambda: 1 in worker_pids("hang-stop", proc.pid), 60, "rank 1's process")
        stopped_at = time.monotonic()
        os.kill(worker_pids("hang-stop", proc.pid)[1], signal.SIGSTOP)
        out = finish(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    found = check_run(out, run_dir, "frozen")
    assert "process state T (stopped)" in found["explain"], found
    # rank 1 cannot write its own stacks: rank 0, on its node, read them with py-spy
    frozen = (run_dir / "debug" / "attempt-0" / "rank-1.txt").read_text()
    assert "stopped (T (stopped)); its stacks read from outside by py-spy" in frozen, frozen
    assert "Thread " in frozen and "trainer/train.py" in frozen, frozen
    # wherever SIGSTOP found it: a step's phases, the bookkeeping after one (log), a checkpoint
    assert any(f"in {phase} at step" in found["explain"] for phase in ("data", "forward", "backward", "optimizer", "vote", "log", "checkpoint"))
    print(f"SIGSTOP -> run finished in {time.monotonic() - stopped_at:.0f} s")


@pytest.mark.slow
def test_a_clean_run_with_checkpoints_and_evaluation_raises_no_alarm(tmp_path):
    """Checkpoints every 10 steps and an evaluation every epoch, at a 5 s floor (the steps are
    short, so the floor is the deadline): no verdict, no debug directory."""
    proc, run_dir = start(tmp_path, "clean", {"where": "none", "marker": str(tmp_path / "unused"), "samples": 1024},
                          eval_every_epochs=1, hang_floor_s=5)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert not hang_verdicts(out) and not (run_dir / "debug").exists()


@pytest.mark.slow
@pytest.mark.parametrize("trial", [0, 1])
def test_a_clean_run_on_a_machine_that_gets_loaded_mid_run_raises_no_alarm(tmp_path, trial):
    """The same clean run at a 2 s floor (the default is 20 s), and after its first 20 steps,
    timed on an idle machine, 4 busy processes per core take the CPUs away until it ends: the
    steps slow down several times over, the deadlines follow, and no alarm is raised."""
    proc, run_dir = start(tmp_path, f"loaded-{trial}", {"where": "none", "marker": str(tmp_path / "unused"), "samples": 1024},
                          max_steps=600, eval_every_epochs=1, hang_floor_s=2)
    hogs = []
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 20, 300, "20 training steps")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4 * (os.cpu_count() or 1))]
        loaded_at, t0 = len(logged_steps(run_dir)), time.monotonic()
        out = finish(proc)
        took = time.monotonic() - t0
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    steps = logged_steps(run_dir)
    assert len(steps) - loaded_at > 100, (loaded_at, len(steps))  # most of the run was loaded
    print(f"{len(steps) - loaded_at} steps (evaluations, checkpoints) in {took:.0f} s under load, no alarm")
    assert not hang_verdicts(out) and not (run_dir / "debug").exists(), out[-3000:]
