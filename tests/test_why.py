"""`ddpkit why` (deploy/why.py): the cause of a run in one line, from what real runs leave.

Real torchrun output (a worker killed, then one that raises) read as a log; Slurm's and the
kubelet's words through the status line; and real 2-rank local runs, one per fault kind: an
exception on rank 1, rank 1 SIGKILLed, a setting refused at start, a kill that a restart
recovers from, and a clean run. The hang is checked in tests/test_watchdog.py's runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.slurm.submit import _describe, parse_scontrol
from deploy.why import CATEGORIES, explain, log_cause, state_cause
from tests.conftest import cli
from tests.trainer_util import REPO, free_port, launch_env, run

WORKER = """
import os, signal, time
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if rank == 1 and restart == 0:
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 0 and restart == 1:
    raise ValueError("boom on rank 0")
time.sleep(2)
"""


def torchrun_stderr(tmp: Path, restarts: int) -> str:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "--max-restarts", str(restarts), str(script)],
                          cwd=tmp, capture_output=True, text=True, timeout=180,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))})
    assert proc.returncode != 0
    return proc.stderr


@pytest.mark.slow
def test_real_torchrun_output_names_the_signal_or_the_exception(tmp_path):
    killed = log_cause(torchrun_stderr(tmp_path, restarts=0))
    assert killed.category == "killed" and "SIGKILL" in killed.evidence, killed
    raised = log_cause(torchrun_stderr(tmp_path, restarts=1).split("of binary", 1)[1])  # after the kill
    assert raised.category == "exception" and "ValueError: boom on rank 0" in raised.evidence, raised


def test_the_scheduler_words_win_for_what_only_it_knows():
    line = ("JobId=7 JobName=demo JobState=NODE_FAIL Reason=NodeDown Dependency=(null) Requeue=0 "
            "Restarts=0 BatchFlag=1 ExitCode=0:0 RunTime=00:01:02 TimeLimit=00:10:00")
    cause = state_cause(_describe(parse_scontrol(line)))
    assert cause.category == "node-lost", cause
    timeout = state_cause(_describe(parse_scontrol(line.replace("NODE_FAIL", "TIMEOUT"))))
    assert timeout.category == "time-limit"
    oom = state_cause("FAILED [node rank 1: OOMKilled (exit 137) on node-b]")
    assert oom.category == "oom" and "node-b" in oom.evidence
    pending = state_cause("PENDING (not scheduled: Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu.)")
    assert pending.category == "unschedulable"
    assert state_cause("PENDING (Slurm reason: Resources)").category == "queued"
    # how sacct says a forgotten job ended (deploy/slurm/submit.py _describe_ended)
    assert state_cause("FAILED (killed by signal 9 (SIGKILL); nodes: n1)").category == "killed"
    assert state_cause("FAILED (exit code 1; nodes: n1)").category == "exception"
    assert explain("FAILED (exit code 1; nodes: n1)", "")[0] == "exception: exit code 1; nodes: n1"
    # an exit code alone does not outrank the log, which names the exception
    assert explain("FAILED (exit code 1)", "ValueError: bad\nE1 failed (exitcode: 1) local_rank: 1 (pid: 9) of binary: p")[0] \
        == "exception: ValueError: bad (exit 1)"
    assert state_cause("RUNNING (1 of 2 pods waiting: ImagePullBackOff: Back-off pulling image)").category == "image"
    # a log that shows why, under a plain FAILED: the log names it
    assert explain("FAILED", "Traceback...\nValueError: bad\nE1202 x] failed (exitcode: 1) local_rank: 1 (pid: 9) of binary: p")[0] \
        == "exception: ValueError: bad (exit 1)"
    assert set(CATEGORIES) >= {"hang", "exception", "killed", "oom", "node-lost", "preempted", "time-limit",
                               "unschedulable", "image", "mount", "config", "cancelled", "completed"}


# -- real runs ----------------------------------------------------------------------------------

def run_faulty(tmp: Path, name: str, restarts: int = 0, **model_args) -> Path:
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump({
        "name": name, "image": "ddpkit:0.1", "procs_per_node": 2, "restarts": restarts,
        "checkpoint": {"every_steps": 4, "keep": 2},
        "train": {"model": "tests.user_workloads:faulty", "model_args": model_args, "max_steps": 16,
                  "epochs": 10, "batch_size": 32, "threads": 1, "eval_every_epochs": 0, "plot": False}}))
    env = {**launch_env(job), "PYTHONPATH": str(REPO), "DDPKIT_STOP_GRACE_S": "10"}
    subprocess.run([sys.executable, "-m", "deploy", "run", str(job), "--local"], cwd=tmp, env=env,
                   capture_output=True, text=True, timeout=400)
    return tmp / "runs" / name


def why(run_dir: Path) -> list[str]:
    result = cli("why", str(run_dir))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("fault, first", [
    ("raise", "exception: rank 1 on {host}, attempt 0: ValueError: injected fault on rank 1 after 5 steps at "),
    ("kill", "killed: rank 1 on {host}, attempt 0: exit -9 (SIGKILL"),
    ("exit", "failed: rank 1 on {host}, attempt 0: exit 3"),
])
def test_a_rank_that_fails_is_named_with_how(tmp_path, fault, first):
    lines = why(run_faulty(tmp_path, f"why-{fault}", fault=fault, after=5))
    assert lines[0].startswith(first.format(host=socket.gethostname())), lines
    if fault == "raise":
        assert "in forward" in lines[0] and "user_workloads.py" in lines[0], lines


@pytest.mark.slow
def test_a_setting_refused_at_start_is_a_config_cause(tmp_path):
    lines = why(run_faulty(tmp_path, "why-config", fault="raise", after="many"))  # int("many") fails
    # model_args reach the workload's constructor: a ValueError while building it, before training
    assert lines[0].startswith(("exception: ", "config: ")) and "many" in lines[0], lines
    assert "attempt 0" in lines[0] and "rank" in lines[0], lines


@pytest.mark.slow
def test_a_run_that_recovered_says_completed_and_keeps_the_failed_attempt(tmp_path):
    lines = why(run_faulty(tmp_path, "why-recovered", restarts=1, fault="kill", after=5,
                           marker=str(tmp_path / "killed-once")))
    assert lines[0].startswith("completed: attempt 1: step 16/16"), lines
    assert any(line.strip().startswith("attempt 0: killed: rank 1 on") for line in lines), lines


def launch(tmp: Path, job: dict, nproc: int, **env: str) -> subprocess.CompletedProcess:
    """`python -m trainer.launch` of `job` (what every target starts), as the tests' runs do."""
    path = tmp / f"{job['name']}.yaml"
    path.write_text(yaml.safe_dump(job))
    return run(path, tmp, nproc=nproc, **env)


@pytest.mark.slow
def test_a_launch_that_never_trains_says_why(tmp_path):
    """What the launcher refuses or torchrun cannot start: a missing script (config), the
    master's port taken by another process (rendezvous), and a resume at another world size
    (config: the checkpoint's refusal, in an attempt that wrote no progress record)."""
    host = socket.gethostname()
    launch(tmp_path, {"name": "noscript", "script": "nope.py"}, 1)
    [line] = why(tmp_path / "runs" / "noscript")
    assert line.startswith(f"config: on {host}, attempt 0: script nope.py: no such file"), line

    train = {"model": "cnn", "max_steps": 6, "epochs": 1, "batch_size": 32, "threads": 1,
             "eval_every_epochs": 0, "plot": False}
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with taken:
        launch(tmp_path, {"name": "port", "train": train}, 2, DDPKIT_MASTER_PORT=str(taken.getsockname()[1]))
    line = why(tmp_path / "runs" / "port")[0]
    assert line.startswith(f"rendezvous: on {host}, attempt 0: ") and "EADDRINUSE" in line, line

    job = {"name": "resized", "train": train, "checkpoint": {"every_steps": 3, "keep": 2}}
    assert launch(tmp_path, job, 2, DDPKIT_STOP_AT_STEP="3").returncode == 143
    launch(tmp_path, job, 1)
    lines = why(tmp_path / "runs" / "resized")
    assert lines[0].startswith("config: rank 0 on") and "attempt 1: ConfigError: checkpoint" in lines[0], lines
    assert "was written by 2 ranks, this run has 1" in lines[0]
    assert lines[1].startswith("  attempt 0: stopped: attempt 0: after the checkpoint of step"), lines
