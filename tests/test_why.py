"""`ddpkit why` (deploy/why.py): the cause of a run in one line, from what real runs leave.

Real torchrun output (a worker killed, then one that raises) read as a log; Slurm's and the
kubelet's words through the status line; and real 2-rank local runs, one per fault kind: an
exception on rank 1, rank 1 SIGKILLed, a setting refused at start, a kill that a restart
recovers from, and a clean run. The hang is checked in tests/test_watchdog.py's runs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from deploy.slurm.submit import _describe, parse_scontrol
from deploy.why import CATEGORIES, explain, log_cause, state_cause
from tests.conftest import cli, ddpkit, require
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


SAME_SECOND = """
import os, pathlib, time
rank = int(os.environ["RANK"])
pathlib.Path(f"ready-{rank}").touch()
while not all(pathlib.Path(f"ready-{r}").exists() for r in (0, 1)):  # both started: fail together
    time.sleep(0.01)
if rank == 1:
    os._exit(3)
time.sleep(0.05)  # rank 0 "notices" its peer is gone and raises, as gloo makes it do
raise RuntimeError("Connection reset by peer")
"""


@pytest.mark.slow
def test_every_worker_torchrun_saw_fail_is_recorded_not_only_its_first(tmp_path):
    """torchrun's `failed (exitcode ...)` line names one worker, by whole-second timestamps: rank
    0 raising because rank 1 died can be named instead of rank 1. Its failure table lists both."""
    from trainer.attempts import LaunchRecord

    script = tmp_path / "worker.py"
    script.write_text(SAME_SECOND)
    # torchrun looks every 3 s here: both have failed by its next look, however loaded the machine
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "--monitor-interval", "3", str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))})
    assert proc.returncode != 0, proc.stderr[-2000:]
    record = LaunchRecord(None, node_rank=1, nproc=2)
    for line in proc.stderr.splitlines(keepends=True):
        record.feed(line)
    assert sorted((f["rank"], f["exitcode"]) for f in record.failures) == [(2, 1), (3, 3)], \
        (record.failures, proc.stderr[-3000:])

DIED_THEN_PEER_RAISED = """
import os, pathlib, signal, time
from torch.distributed.elastic.multiprocessing.errors import record
from trainer.train import torchrun_error_handler

rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def main():
    if restart:
        return
    pathlib.Path(f"ready-{rank}").touch()
    while not all(pathlib.Path(f"ready-{r}").exists() for r in (0, 1)):
        time.sleep(0.01)
    if rank == 0:  # both fail in the same second, late in it: torchrun looks in a later one
        pathlib.Path(".when").write_text(str(int(time.time()) + 1.85))
        os.replace(".when", "when")
    while not pathlib.Path("when").exists():
        time.sleep(0.01)
    time.sleep(max(0.0, float(pathlib.Path("when").read_text()) - time.time()))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)  # gloo's words when the peer's socket closes
    raise RuntimeError("Read error [127.0.0.1]:4242: Connection reset by peer")


record(main, torchrun_error_handler())()
"""


@pytest.mark.slow
def test_torchrun_names_the_rank_that_died_not_the_peer_that_raised_after_it(tmp_path):
    """With restarts left torchrun prints one `failed (exitcode ...)` line, for the failure with
    the smallest whole-second timestamp, and no table: rank 0's error file, dated when it raised,
    would beat rank 1's death, dated when torchrun looked. The trainer's error handler dates a
    peer's "connection reset" later, so torchrun itself names rank 1 and its SIGKILL."""
    (tmp_path / "worker.py").write_text(DIED_THEN_PEER_RAISED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "--monitor-interval", "3", "--max-restarts", "1",
                           "worker.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = [line for line in proc.stderr.splitlines() if "failed (exitcode" in line]
    assert len(failed) == 1 and "failed (exitcode: -9) local_rank: 1 " in failed[0], proc.stderr[-3000:]


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

    # an IterableDataset's position is per rank: its checkpoint resumes on the same world size only
    job = {"name": "resized", "checkpoint": {"every_steps": 2, "keep": 2},
           "train": {**train, "model": "tests.user_workloads:iterable", "batch_size": 8, "max_steps": 40, "epochs": 5}}
    assert launch(tmp_path, job, 2, DDPKIT_STOP_AT_STEP="3").returncode == 143
    launch(tmp_path, job, 1)
    lines = why(tmp_path / "runs" / "resized")
    assert lines[0].startswith("config: rank 0 on") and "attempt 1: ConfigError: checkpoint" in lines[0], lines
    assert "was written by 2 ranks, this run has 1: the data position of an IterableDataset is per rank" in lines[0]
    assert lines[1].startswith("  attempt 0: stopped: attempt 0: after the checkpoint of step"), lines


# -- the fault corpus (docs/faults.md "Why did it fail?": every local row of the table) ---------

def timed_why(run_dir: Path) -> tuple[list[str], float]:
    """`ddpkit why` as a user runs it (a fresh interpreter), and how long it took to answer."""
    started = time.monotonic()
    proc = ddpkit("why", str(run_dir))
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    print(f"why answered in {took:.2f}s: {proc.stdout.splitlines()[0]}")  # a figure: bench/fault_corpus.py
    return proc.stdout.splitlines(), took


@pytest.mark.slow
def test_a_nan_loss_stops_the_run_naming_the_step_and_the_rank(tmp_path):
    """Rank 1's loss turns NaN after 5 steps: the check every log_every_steps (10) stops the
    run with FloatingPointError (DDP spreads the NaN: rank 0's loss is NaN too by then)."""
    lines, _ = timed_why(run_faulty(tmp_path, "why-nan", fault="nan", after=5))
    assert lines[0].startswith("exception: rank ") and "attempt 0: FloatingPointError: loss is nan at step " in lines[0], lines
    assert "train.stop_on_nonfinite_loss" in lines[0]


def mounted_tmpfs(path: Path, size: str) -> None:
    require(os.geteuid() == 0, "a small tmpfs needs root (mount)")
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    require(proc.returncode == 0, f"mount -t tmpfs failed: {proc.stderr.strip()}")


@pytest.mark.slow
def test_a_full_disk_is_named_with_the_file_that_did_not_fit(tmp_path):
    """The checkpoint directory on a 16 KiB tmpfs: the first checkpoint (the cnn's, ~100 KiB)
    fails with ENOSPC on rank 0, which `why` names as disk-full."""
    ckpt = tmp_path / "full"
    mounted_tmpfs(ckpt, "16k")
    try:
        job = {"name": "why-full", "checkpoint": {"dir": str(ckpt), "every_steps": 3, "keep": 2},
               "train": {"model": "cnn", "max_steps": 8, "epochs": 1, "batch_size": 32, "threads": 1,
                         "eval_every_epochs": 0, "plot": False}}
        launch(tmp_path, job, 2)
        lines, _ = timed_why(tmp_path / "runs" / "why-full")
    finally:
        subprocess.run(["umount", str(ckpt)], check=False)
    assert lines[0].startswith("disk-full: rank 0 on") and "No space left on device" in lines[0], lines
    assert "ckpt-000000003.pt" in lines[0] and "checkpoint.py" in lines[0], lines


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_skipped_and_named(tmp_path):
    """Stopped at step 8 (its stop checkpoint), one byte of the newest checkpoint flipped: the
    next start resumes from the one before and completes; `why` says so, naming the skipped
    file and its problem."""
    train = {"model": "cnn", "max_steps": 12, "epochs": 10, "batch_size": 32, "threads": 1,
             "eval_every_epochs": 0, "plot": False}
    job = {"name": "why-corrupt", "train": train, "checkpoint": {"every_steps": 4, "keep": 3}}
    assert launch(tmp_path, job, 2, DDPKIT_STOP_AT_STEP="8").returncode == 143
    *_, previous, newest = sorted((tmp_path / "runs" / "why-corrupt" / "checkpoints").glob("ckpt-*.pt"))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert launch(tmp_path, job, 2).returncode == 0
    lines, _ = timed_why(tmp_path / "runs" / "why-corrupt")
    step = int(previous.stem.split("-")[1])
    assert lines[0] == (f"completed: attempt 1: step 12/12; resumed from step {step}, checkpoints skipped: "
                        f"{newest.name} (checksum mismatch (corrupt or truncated))"), lines


@pytest.mark.slow
def test_a_collective_timeout_names_the_rank_that_never_joined(tmp_path):
    """The watchdog off, train.timeout_s 10: rank 1 sleeps in its forward, rank 0's all-reduce
    in backward times out (gloo's words); `why` calls it a hang and names rank 1, not rank 0."""
    job = {"name": "why-timeout", "train": {
        "model": "tests.user_workloads:hang", "model_args": {"where": "forward", "after": 5,
                                                             "marker": str(tmp_path / "hung")},
        "max_steps": 40, "epochs": 10, "batch_size": 32, "threads": 1, "eval_every_epochs": 0,
        "plot": False, "watchdog": False, "timeout_s": 10}}
    started = time.monotonic()
    launch(tmp_path, job, 2, DDPKIT_STOP_GRACE_S="5")
    print(f"run ended {time.monotonic() - started:.0f}s after its start")
    lines, _ = timed_why(tmp_path / "runs" / "why-timeout")
    assert lines[0].startswith(f"hang: rank 1 on {socket.gethostname()}, attempt 0: collective timeout: rank(s) 0 "
                               "waited in backward at step"), lines
    assert "Timed out waiting" in lines[0] and "rank(s) 1 never joined" in lines[0], lines


@pytest.mark.slow
def test_a_master_name_that_does_not_resolve_is_a_rendezvous_cause(tmp_path):
    """Node rank 1 of a PyTorchJob (the operator's PET_* variables) whose master's name does not
    resolve: its launcher waits train.timeout_s (10 s) for the master, then says why."""
    job = {"name": "why-dns", "train": {"model": "cnn", "max_steps": 4, "epochs": 1, "batch_size": 32,
                                        "threads": 1, "eval_every_epochs": 0, "plot": False, "timeout_s": 10}}
    launch(tmp_path, job, 2, PET_NNODES="2", PET_NODE_RANK="1", PET_NPROC_PER_NODE="2",
           PET_MASTER_ADDR="no-such-host.invalid", PET_MASTER_PORT="29500")
    lines, _ = timed_why(tmp_path / "runs" / "why-dns")
    assert lines[0].startswith(f"rendezvous: on {socket.gethostname()}, attempt 0: master no-such-host.invalid:29500 "
                               "not reachable after 10s: host 'no-such-host.invalid' does not resolve (DNS)"), lines


def memory_cgroup(tmp_name: str, limit: int) -> Path:
    """A memory cgroup of `limit` bytes beside this process's (v1 or v2), for the launcher."""
    require(os.geteuid() == 0, "a memory cgroup needs root")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / tmp_name
            limit_file = "memory.limit_in_bytes"
            break
    else:  # v2: a child of the root, which delegates memory to its children
        root = Path("/sys/fs/cgroup")
        require("memory" in (root / "cgroup.subtree_control").read_text().split(),
                "cgroup v2 without the memory controller delegated at the root")
        group, limit_file = root / tmp_name, "memory.max"
    try:
        group.mkdir(exist_ok=True)
        (group / limit_file).write_text(str(limit))
    except OSError as e:
        require(False, f"cannot make a memory cgroup at {group}: {e}")
    return group


@pytest.mark.slow
def test_a_rank_the_oom_killer_ends_is_named_oom(tmp_path):
    """The launcher in a 2.5 GiB memory cgroup; rank 1 allocates until the kernel's OOM killer
    ends it (SIGKILL): the launcher counted the kill in its cgroup, so `why` says oom, not a
    plain kill -9."""
    group = memory_cgroup(f"ddpkit-oom-{os.getpid()}", int(2.5 * 2**30))
    job = tmp_path / "why-oom.yaml"
    job.write_text(yaml.safe_dump({
        "name": "why-oom", "train": {"model": "tests.user_workloads:faulty", "model_args": {"fault": "oom", "after": 3},
                                     "max_steps": 40, "epochs": 10, "batch_size": 32, "threads": 1,
                                     "eval_every_epochs": 0, "plot": False}}))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=tmp_path, env=launch_env(job, 2),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        out, _ = proc.communicate(timeout=300)
    finally:
        for _ in range(50):  # the cgroup goes once its last process has
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    assert proc.returncode != 0, out[-3000:]
    lines, _ = timed_why(tmp_path / "runs" / "why-oom")
    assert lines[0].startswith(f"oom: rank 1 on {socket.gethostname()}, attempt 0: exit -9 (SIGKILL by the OOM killer"), lines


@pytest.mark.slow
def test_a_script_job_leaves_every_ranks_stacks_and_a_verdict(tmp_path):
    """Your own torchrun script (tests/hang_script.py: rank 1 sleeps outside any collective):
    when its process group's 10 s timeout fires on rank 0, every rank's stacks are written
    (rank 0's with the exception, rank 1's at torchrun's SIGTERM) and the launcher's verdict
    names rank 1 and its line; a stop (SIGTERM to the launcher) writes them too."""
    shutil.copy(REPO / "tests" / "hang_script.py", tmp_path / "hang.py")
    job = {"name": "why-script", "script": "hang.py"}
    started = time.monotonic()
    out = launch(tmp_path, job, 2).stdout
    print(f"collective timeout (10 s) -> run ended after {time.monotonic() - started:.0f}s")
    run_dir = tmp_path / "runs" / "why-script"
    debug = run_dir / "debug" / "attempt-0"
    assert "hang.py\", line 20 in main" in (debug / "rank-1.txt").read_text()  # the sleep
    assert "all_reduce" in (debug / "rank-0.txt").read_text() and "Timed out" in (debug / "rank-0.txt").read_text()
    assert "ddpkit-hang " in out
    lines, _ = timed_why(run_dir)
    assert lines[0].startswith(f"hang: rank 1 on {socket.gethostname()}, attempt 0: collective timeout on rank 0 (RuntimeError: "), lines
    assert f"rank 1: on {socket.gethostname()} at hang.py:20 in main (outside any collective)" in lines[0], lines
    assert "rank 0: on" in lines[0] and "hang.py:21 in main (waiting in all_reduce)" in lines[0], lines
    # on Slurm, srun may stop node 0's launcher after another node's ranks timed out
    from trainer import guard

    timed_out = (debug / "verdict.txt").read_text()
    (debug / "verdict.txt").unlink()
    again = guard.write_verdict(run_dir, 2, stopped="a stop signal")
    assert again and again["cause"] == "collective-timeout" and again["culprits"] == [1], again
    assert json.loads(timed_out)["explain"] == again["explain"]

    job = {"name": "why-script-stop", "script": "hang.py"}
    path = tmp_path / "stop.yaml"
    path.write_text(yaml.safe_dump(job))
    from tests.trainer_util import start as start_launch

    proc = start_launch(path, tmp_path, 2, TIMEOUT_S="600")
    run_dir = tmp_path / "runs" / "why-script-stop"
    (tmp_path / "asleep-rank1").unlink()  # the first run's
    deadline = time.monotonic() + 120
    while not (tmp_path / "asleep-rank1").exists():
        assert time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(2)  # rank 1 asleep, rank 0 in the all-reduce
    proc.send_signal(15)
    proc.communicate(timeout=120)
    lines, _ = timed_why(run_dir)
    assert lines[0].startswith("stopped: attempt 0: stopped by a stop signal; where each rank was: rank 0: on "), lines
    assert "(waiting in all_reduce)" in lines[0] and "hang.py:20 in main (outside any collective)" in lines[0], lines


@pytest.mark.slow
def test_a_job_the_scheduler_says_completed_shows_how_far_from_its_logs_last_record():
    """No run directory to read (Kubernetes: the pods' log is all there is): the log's last
    `ddpkit-progress` record says the attempt and the step, as a run directory would."""
    record = {"attempt": 1, "state": "completed", "step": 20, "total_steps": 20}
    log = f"[default0]:ddpkit-progress {json.dumps({**record, 'state': 'running', 'step': 19})}\n" \
          f"[default0]:ddpkit-progress {json.dumps(record)}\n"
    assert explain("SUCCEEDED", log)[0] == "completed: attempt 1: step 20/20"
    assert explain("SUCCEEDED", "no record here\n")[0] == "completed: the scheduler says the job completed"
    running = log.replace('"completed"', '"running"')
    assert explain("SUCCEEDED", running)[0] == "completed: the scheduler says the job completed"


def test_a_script_job_that_succeeded_is_completed(tmp_path):
    """A script that takes no optimizer step (trainer/script_steps.py counts none): completed at
    step 0, not "failed: attempt record says None"; and without the guard's records (a run
    directory of the launchers' alone) the launchers' exits 0 say the same."""
    (tmp_path / "ok.py").write_text(
        "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
        "dist.destroy_process_group()\n")
    assert launch(tmp_path, {"name": "why-script-ok", "script": "ok.py"}, 2).returncode == 0
    run_dir = tmp_path / "runs" / "why-script-ok"
    lines, _ = timed_why(run_dir)
    assert lines[0] == "completed: attempt 0: step 0", lines
    for record in (run_dir / "attempts").glob("attempt-*"):
        record.unlink()
    lines, _ = timed_why(run_dir)
    assert lines[0] == "completed: attempt 0: every worker exited 0 (torchrun on 1 node(s))", lines


@pytest.mark.slow
def test_why_names_the_scripts_own_line_with_the_library_frame_as_context(tmp_path):
    """The innermost frame is often a library's (torch, json, ...): `why` points at the user's
    line that called it, the library frame after it."""
    (tmp_path / "lib_fault.py").write_text(
        "import json, os\nimport torch.distributed as dist\n\n\ndef main():\n    dist.init_process_group('gloo')\n"
        "    if os.environ['RANK'] == '1':\n        json.loads('{not json')\n    dist.barrier()\n\n\nmain()\n")
    assert launch(tmp_path, {"name": "why-lib", "script": "lib_fault.py"}, 2).returncode != 0
    lines, _ = timed_why(tmp_path / "runs" / "why-lib")
    assert lines[0].startswith(f"exception: rank 1 on {socket.gethostname()}, attempt 0: JSONDecodeError: "), lines
    assert "lib_fault.py:8 in main (in " in lines[0] and "json/decoder.py:" in lines[0], lines
