"""The progress record and goodput ledger (trainer/progress.py) and `ddpkit status` reading it
(deploy/progress.py): unit checks of the parts, then a real 2-rank run with a rank killed, read
while it runs and after, against the step times the trainer logs in metrics.jsonl."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.progress import Report, duration, local_state, progress_text
from tests.conftest import cli
from tests.test_faults import ddpkit_run, logged_steps, worker_pids, write_ddpkit_job
from tests.trainer_util import records, wait_for
from trainer.progress import CLASSES, PREFIX, Ledger, last_record


@given(st.lists(st.tuples(st.sampled_from(sorted(CLASSES)), st.floats(0, 1e4)), max_size=40))
def test_the_ledger_books_every_second_once(changes):
    """Whatever the trainer enters when, the classes add up to the wall time."""
    t0 = 1_000_000.0
    ledger, now = Ledger(t0), t0
    for phase, dt in changes:
        now += dt
        ledger.enter(phase, at=now)
    end = now + 1.5
    assert sum(ledger.snapshot(end).values()) == pytest.approx(end - t0, rel=1e-9, abs=1e-6)


def test_the_newest_whole_record_is_found_behind_a_launcher_prefix():
    good = {"step": 7, "total_steps": 10}
    text = "\n".join([
        PREFIX + json.dumps({"step": 3}),
        "[default0]:" + PREFIX + json.dumps(good),
        "[default0]:" + PREFIX + '{"step": 9, "tot',  # cut short: the tail began (or ended) inside it
        "some other line",
    ])
    assert last_record(text) == good
    assert last_record("no records here\n") is None


def test_the_status_line_keeps_the_state_first_and_says_progress_eta_goodput_restarts():
    record = {"state": "running", "step": 120, "total_steps": 500, "epoch": 0, "epochs": 5,
              "samples_per_s": 850.4, "eta_s": 432, "restarts": 1, "restarts_allowed": 3,
              "updated": 100.0, "run": {"goodput": 0.912}}
    text = Report("RUNNING", record, waited_s=12).text(now=104.0)
    assert text.split()[0] == "RUNNING"
    assert text == ("RUNNING  step 120/500 (24%)  epoch 1/5  850 samples/s  ETA 7m12s  goodput 91%  "
                    "restarts 1/3  (4s ago)  waited 12s to start")
    assert progress_text({**record, "state": "completed", "step": 500}).startswith("step 500/500 (100%)")
    assert "ETA" not in progress_text({**record, "state": "completed"})
    assert [duration(s) for s in (5, 61, 3700, 90000)] == ["5s", "1m01s", "1h01m", "1d01h"]
    as_json = Report("FAILED (NODE_FAIL: a node ...)", record).as_json("slurm://7")
    assert as_json["state"] == "FAILED" and as_json["detail"] == "NODE_FAIL: a node ..."


def test_a_local_run_state_follows_its_processes():
    """RUNNING while rank 0 lives, RESTARTING while only its torchrun agent does, FAILED when
    both are gone; an attempt that ended on its own says how (real processes, real pids)."""
    import socket

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        base = {"host": socket.gethostname(), "attempt": 2, "state": "running", "step": 5}
        assert local_state({**base, "pid": alive.pid, "agent_pid": dead.pid}) == "RUNNING"
        assert local_state({**base, "pid": dead.pid, "agent_pid": alive.pid}).startswith("RESTARTING")
        assert local_state({**base, "pid": dead.pid, "agent_pid": dead.pid}).startswith("FAILED")
        assert local_state({**base, "state": "failed", "agent_pid": alive.pid}).startswith("RESTARTING")
        assert local_state({**base, "state": "failed", "agent_pid": dead.pid}).startswith("FAILED")
        assert local_state({**base, "state": "completed"}) == "SUCCEEDED"
        assert local_state({**base, "state": "stopped"}).startswith("CANCELLED")
    finally:
        alive.kill()


def test_status_of_a_directory_without_records_is_one_clear_line(tmp_path):
    result = cli("status", str(tmp_path))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no attempt records" in result.stderr


def step_seconds(run_dir) -> tuple[float, int]:
    """The training time the trainer's own metrics say: the sum of the logged step times
    (global batch / samples_per_s) of every step of every attempt, and how many steps."""
    recs = [r for r in records(run_dir) if r.get("samples_per_s") and "loss" in r and not r.get("summary")]
    batch = records(run_dir)[-1]["global_batch"]
    return sum(batch / r["samples_per_s"] for r in recs), len(recs)


@pytest.mark.slow
def test_a_killed_and_restarted_run_books_its_time_and_status_follows_it(tmp_path):
    """A real 2-rank `ddpkit run --local` with restarts=1, rank 1 killed mid-run: `ddpkit status
    RUN_DIR` says RUNNING with the step while it trains; afterwards it says SUCCEEDED with
    restarts 1/1; attempt 1 booked redone steps and the time between the attempts; every
    attempt's classes add up to its wall time (1%), the run's to the run's; and the step time
    the ledger books (productive + redone + blocking saves) agrees with the step times in
    metrics.jsonl (5%)."""
    train = {"max_steps": 60, "epochs": 2, "data_samples": 4096, "lr": 0.05}
    job = write_ddpkit_job(tmp_path, "ledger", train, every=20, restarts=1)
    run_dir = tmp_path / "runs" / "ledger"
    t_start = time.time()
    proc = ddpkit_run(job, tmp_path)
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 30, 480, "30 training steps")
        running = cli("status", str(run_dir))
        wait_for(lambda: 1 in worker_pids("ledger", proc.pid), 60, "rank 1's process")
        os.kill(worker_pids("ledger", proc.pid)[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    t_end = time.time()
    assert proc.returncode == 0, out[-4000:]
    assert running.returncode == 0 and running.stdout.split()[0] == "RUNNING", running.stdout
    assert " step " in running.stdout and "/60" in running.stdout and "restarts 0/1" in running.stdout

    done = cli("status", str(run_dir), "--json")
    report = json.loads(done.stdout)
    assert report["state"] == "SUCCEEDED", done.stdout
    record = report["progress"]
    assert record["attempt"] == 1 and record["restarts"] == 1 and record["step"] == 60
    assert "restarts 1/1" in cli("status", str(run_dir)).stdout
    first = json.loads((run_dir / "attempts" / "attempt-0.json").read_text())
    for attempt in (first, record):
        assert sum(attempt["classes"].values()) == pytest.approx(attempt["wall_s"], rel=0.01)
    run = record["run"]
    assert sum(run["classes"].values()) == pytest.approx(run["wall_s"], rel=0.01)
    assert run["classes"]["redone"] > 0 and run["classes"]["between_attempts"] > 0
    assert record["classes"]["checkpoint_load"] > 0 and first["classes"]["checkpoint_load"] < 0.5
    assert 0 < run["goodput"] < 1
    # The run as this test saw it from outside, `ddpkit run` to its exit: the ledger books the
    # launch on (DDPKIT_LAUNCH_T0) up to the final record; the CLI's own start and the exit
    # after the record are not in it (seconds on a loaded 2-core machine).
    outside = t_end - t_start
    print(f"ledger wall {run['wall_s']:.1f}s of {outside:.1f}s outside; goodput {run['goodput']:.3f}")
    assert 0.6 * outside < run["wall_s"] <= outside
    booked = sum(run["classes"][k] for k in ("productive", "redone", "checkpoint_save"))
    # 5%, and 1 ms a step for what the ledger books between two steps that a step's own time
    # leaves out (the log line, the progress record: 5.05% over, 0.153 s in a 3-s run, once on
    # a loaded machine); the redone steps (10 or more here, ~40 ms each) booked twice or not at
    # all would still be over
    timed, steps = step_seconds(run_dir)
    assert booked == pytest.approx(timed, rel=0.05, abs=0.001 * steps)
    # the record's log lines are for programs reading cluster logs: kept out of the terminal
    assert "ddpkit-progress " not in out and "resumed from" in out
    # ... and in RUN_DIR/output.log, every line tagged [0/RANK] as on Slurm, for `ddpkit logs`
    assert not re.search(r"^\[0/", out, re.M), out[:2000]
    summary = cli("logs", str(run_dir), "--all", "--grep", "ddpkit-summary").stdout.splitlines()
    assert len(summary) == 1 and summary[0].startswith("[0/-] ddpkit-summary {"), summary
    assert json.loads(summary[0].split(" ", 2)[2])["steps"] > 0
    rank0 = cli("logs", str(run_dir), "--worker-rank", "0", "--grep", "resumed from").stdout
    assert "ddpkit rank 0" in rank0 and not re.search(r"^\[0/", rank0, re.M), rank0
    assert "ddpkit-progress " in cli("logs", str(run_dir)).stdout


@pytest.mark.slow
def test_prometheus_reads_the_counters_from_the_endpoint_and_the_textfile(tmp_path):
    """`train.prometheus_port` and `train.prometheus_textfile` on a real 2-rank run, read with
    prometheus-client's own text parser: the endpoint answers while it trains, and the textfile
    ends with the last step and the run's time classes."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.trainer_util import free_port

    def samples(text: str) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("class", "")): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    port = free_port()
    # 400 steps: the endpoint lives while the run trains, and 40 cnn steps (0.8 s here since
    # 2026-12-06) ended before the first scrape; 400 leave it about 8 s.
    train = {"max_steps": 400, "epochs": 4, "prometheus_port": port, "prometheus_textfile": "metrics.prom"}
    job = write_ddpkit_job(tmp_path, "prom", train, every=20, restarts=0)
    run_dir = tmp_path / "runs" / "prom"
    proc = ddpkit_run(job, tmp_path)
    try:
        def scrape() -> dict:
            return samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())

        wait_for(lambda: len(logged_steps(run_dir)) >= 1, 480, "the first training step")
        wait_for(lambda: scrape().get(("ddpkit_step", ""), 0) >= 1, 60, "a scrape after a step")
        live = scrape()
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert live[("ddpkit_step", "")] >= 1 and live[("ddpkit_total_steps", "")] == 400
    final = samples((run_dir / "metrics.prom").read_text())
    assert final[("ddpkit_step", "")] == 400 and final[("ddpkit_restarts", "")] == 0
    assert 0 < final[("ddpkit_goodput", "")] < 1 and final[("ddpkit_loss", "")] > 0
    record = json.loads((run_dir / "attempts" / "attempt-0.json").read_text())
    booked = sum(v for (name, _), v in final.items() if name == "ddpkit_time_seconds")
    assert booked == pytest.approx(record["run"]["wall_s"], rel=0.01)


def test_logs_of_a_local_run_dir_by_attempt(tmp_path):
    """RUN_DIR/output.log as `ddpkit run --local` appends it, two runs (lines as its launcher
    tags them): --attempt K is the K-th run, --previous the one before the last."""
    from deploy.run.local import start_line

    run_dir = tmp_path / "runs" / "demo"
    (run_dir / "attempts").mkdir(parents=True)
    (run_dir / "attempts" / "attempt-0.json").write_text(json.dumps({"attempt": 0, "state": "completed", "step": 3}))
    banner = start_line("demo", 2)  # one clock reading: the line carries the time
    first = banner + "[0/-] ddpkit launch: context local\n[0/0] 10:00 ddpkit rank 0 INFO step 1/3\n"
    second = banner + "[0/0] 10:05 ddpkit rank 0 INFO resumed from step 1\n[0/1] [rank1]: boom\n"
    (run_dir / "output.log").write_text(first + second)
    assert cli("logs", str(run_dir), "--previous").stdout == first.replace("[0/-] ", "").replace("[0/0] ", "")
    assert cli("logs", str(run_dir), "--attempt", "1", "--all", "--grep", "boom").stdout == "[0/1] [rank1]: boom\n"
    assert cli("logs", str(run_dir), "--worker-rank", "1").stdout == banner * 2 + "[rank1]: boom\n"
    bad = cli("logs", str(run_dir), "--attempt", "2")
    assert bad.returncode != 0 and "holds attempts 0..1: no attempt 2" in bad.stderr
