"""The warm path's client/template protocol (trainer/warm.py) with real processes and signals:
a template imports torch once and forks each worker a client asks for; the client is the worker
torchrun sees (exit code, signals, death), and a worker is what `python SCRIPT` would have been."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer_util import REPO, wait_for
from trainer.config import TRAINER_ENTRY
from trainer.contract import resident_socket
from trainer.launch import supervise
from trainer.launch.node import JobSettings, warm_start
from trainer.launch.plan import LaunchError, plan_launch

PY = "/usr/bin/python3"

# A worker that says who it is and exits with the code of its first argument.
ECHO = """
import json, os, random, sys
import torch
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "x": os.environ.get("X"),
                  "cwd": os.getcwd(), "random": random.random(), "torch": torch.rand(3).tolist(),
                  "threads": torch.get_num_threads(), "main": __name__}), flush=True)
sys.exit(int(sys.argv[1]))
"""
# A worker that waits; a stop signal makes it write which one came and exit 143.
SLEEPER = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def stop(signum, frame):
    (out / "signal").write_text(signal.Signals(signum).name)
    sys.exit(143)
for s in (signal.SIGTERM, signal.SIGUSR2):
    signal.signal(s, stop)
(out / "pid").write_text(str(os.getpid()))
time.sleep(600)
"""


def env_for(sock: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPKIT_", "TORCHELASTIC_"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", **extra})
    if sock is not None:
        env["DDPKIT_WARM_SOCKET"] = str(sock)
    return env


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """One template for the module (it imports torch once, as on a node), 2 threads per rank
    (numpy's OpenBLAS would start a thread pool: the template must stay single-threaded)."""
    sock = tmp_path_factory.mktemp("warm") / "t.sock"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", str(sock)], env=env_for(),
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # Listening before the first client: a client waits CONNECT_WAIT_S (10 s) for the socket and
    # then starts cold, and a loaded CI machine may take that long to start a Python process.
    wait_for(sock.exists, 60, "the template's socket")
    yield proc, sock  # it imports when the first client connects (the first test's)
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(timeout=30)


def client(sock: Path, script: Path, *args: str, cwd: Path | None = None, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.warm", str(script), *args], cwd=cwd,
                            env=env_for(sock, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sleeper(tmp: Path, sock: Path) -> tuple[subprocess.Popen, int]:
    (tmp / "sleeper.py").write_text(SLEEPER)
    proc = client(sock, tmp / "sleeper.py", str(tmp))
    wait_for(lambda: (tmp / "pid").exists() and (tmp / "pid").read_text(), 60, "the worker's pid")
    return proc, int((tmp / "pid").read_text())


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
def test_a_forked_worker_is_what_python_script_would_be(template, tmp_path):
    """The template is the worker's parent; argv, environment, working directory and stdout are
    the client's; the exit code comes back; `random` and torch's generator are seeded afresh
    in each worker, as in a fresh interpreter (the template's state is not shared)."""
    proc, sock = template
    (tmp_path / "echo.py").write_text(ECHO)
    (tmp_path / "here").mkdir()
    a = client(sock, tmp_path / "echo.py", "3", cwd=tmp_path / "here", X="hello")
    b = client(sock, tmp_path / "echo.py", "0", cwd=tmp_path / "here", X="other")
    out_a, err_a = a.communicate(timeout=120)
    out_b, _ = b.communicate(timeout=120)
    line = proc.stderr.readline()  # "ddpkit warm: template N ready in ...": imported on demand
    assert "ready" in line and "unsafe" not in line, line
    assert a.returncode == 3 and b.returncode == 0, err_a
    ra, rb = json.loads(out_a), json.loads(out_b)
    assert ra["ppid"] == rb["ppid"] == proc.pid and ra["pid"] != a.pid
    assert ra["argv"] == [str(tmp_path / "echo.py"), "3"] and ra["main"] == "__main__"
    assert (ra["x"], rb["x"]) == ("hello", "other") and ra["cwd"] == str(tmp_path / "here")
    assert ra["random"] != rb["random"] and ra["torch"] != rb["torch"]
    assert ra["threads"] == 2  # OMP_NUM_THREADS, as `python SCRIPT` would have


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_ends_its_client_by_that_signal(template, tmp_path):
    _, sock = template
    proc, worker = sleeper(tmp_path, sock)
    os.kill(worker, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL  # what torchrun reports: "exitcode: -9"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2])
def test_a_stop_signal_to_the_client_reaches_the_worker(template, tmp_path, signum):
    _, sock = template
    proc, worker = sleeper(tmp_path, sock)
    proc.send_signal(signum)
    proc.wait(timeout=30)
    assert proc.returncode == 143
    assert (tmp_path / "signal").read_text() == signal.Signals(signum).name


@pytest.mark.slow
def test_a_client_killed_takes_its_worker_with_it(template, tmp_path):
    """torchrun's SIGKILL after its shutdown timeout, or a kill -9 of what it started: the
    template sees the connection close and kills the worker."""
    _, sock = template
    proc, worker = sleeper(tmp_path, sock)
    proc.kill()
    proc.wait(timeout=30)
    wait_for(lambda: gone(worker), 30, f"worker {worker} to end")


@pytest.mark.slow
def test_without_a_template_the_client_starts_the_worker_cold(tmp_path):
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # a socket file nobody listens on: a template that died
    (tmp_path / "echo.py").write_text(ECHO)
    proc = client(stale, tmp_path / "echo.py", "4")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4
    assert json.loads(out)["pid"] == proc.pid  # the client exec'd the worker itself
    assert "starting the worker cold" in err


@pytest.mark.slow
def test_the_template_ignores_stop_signals_and_ends_with_its_stdin(tmp_path):
    """Slurm signals every process of a step: the template stays (its workers get their
    signals through their clients); closing its stdin (the launcher is done, or died) ends it
    and any worker left."""
    sock = tmp_path / "t.sock"
    template = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", str(sock)], env=env_for(),
                                stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc, worker = sleeper(tmp_path, sock)
    assert "ready" in template.stderr.readline()
    template.send_signal(signal.SIGTERM)
    template.send_signal(signal.SIGUSR2)
    time.sleep(0.5)
    assert template.poll() is None and not gone(worker)
    template.stdin.close()
    template.wait(timeout=30)
    wait_for(lambda: gone(worker), 30, f"worker {worker} to end")
    proc.wait(timeout=30)
    assert proc.returncode != 0


@pytest.mark.slow
def test_a_template_that_may_not_fork_has_every_worker_start_cold(tmp_path):
    """A node that asks numpy's OpenBLAS for 2 threads: its pool starts at import, so the
    template has a second thread and must not fork; each client is told so and execs its
    worker cold at once."""
    sock = tmp_path / "t.sock"
    template = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", str(sock)],
                                env=env_for(OPENBLAS_NUM_THREADS="2"), stdin=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        (tmp_path / "echo.py").write_text(ECHO)
        proc = client(sock, tmp_path / "echo.py", "5")
        out, err = proc.communicate(timeout=120)
        line = template.stderr.readline()
        assert "2 threads: forking is unsafe, the workers start cold" in line, line
        assert proc.returncode == 5 and json.loads(out)["pid"] == proc.pid
        assert "ddpkit warm: the template found 2 threads; starting the worker cold" in err
    finally:
        template.stdin.close()
        template.wait(timeout=30)


# torchrun's stand-in: what it was forked with, then one worker through its own client.
AGENT = """
import json, os, subprocess, sys
seen = {"torch": "torch" in sys.modules, "trainer": "trainer.train" in sys.modules, "ppid": os.getppid(),
        "comm": open("/proc/self/comm").read().strip(), "socket": os.environ.get("DDPKIT_WARM_SOCKET")}
import signal, time
from torch.distributed.elastic.multiprocessing import api
signal.signal(signal.SIGTERM, api._terminate_process_handler)  # as torchrun's workers' start does
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except api.SignalException:  # torchrun's shutdown starts; a second SIGTERM now must not end it
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    seen["second_stop_ignored"] = True
worker = subprocess.run([sys.executable, "-m", "trainer.warm", sys.argv[1], "4"], capture_output=True, text=True)
print(json.dumps({**seen, "worker": json.loads(worker.stdout), "worker_rc": worker.returncode}), flush=True)
sys.exit(7)
"""


@pytest.mark.slow
def test_torchrun_itself_is_forked_after_torch_alone_and_its_workers_by_the_same_template(tmp_path):
    """The launcher's client (`--agent`, torchrun's stand-in): the template imports torch, forks
    the agent before the trainer's imports (named ddpkit-agent, the socket left in its
    environment for its workers), and forks the agent's own clients' workers; the agent's
    client ends with the agent's code. torchrun's stop handler raises on the first stop signal
    only (Slurm signals the agent, its client and the launcher: one raised during torchrun's
    shutdown would end it before the workers' stop checkpoint)."""
    sock = tmp_path / "t.sock"
    template = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", str(sock)], env=env_for(),
                                stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (tmp_path / "agent.py").write_text(AGENT)
        (tmp_path / "echo.py").write_text(ECHO)
        proc = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--agent", str(tmp_path / "agent.py"),
                                 str(tmp_path / "echo.py")], env=env_for(sock), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 7, err
        seen = json.loads(out)
        assert seen["torch"] and not seen["trainer"], seen  # forked after torch, before the trainer
        assert seen["second_stop_ignored"], seen
        assert seen["ppid"] == template.pid and seen["comm"] == "ddpkit-agent", seen
        assert seen["socket"] == str(sock)
        assert seen["worker_rc"] == 4 and seen["worker"]["ppid"] == template.pid, seen
        assert "starting" not in err  # nothing cold
    finally:
        template.stdin.close()
        template.wait(timeout=30)
    assert "ready in" in template.stderr.read()  # the trainer's imports were done after the agent's fork


@pytest.mark.slow
def test_a_resident_template_outlives_its_clients_and_ends_after_its_workers_on_sigterm(tmp_path):
    """`--resident` (a Slurm allocation's, started by its batch shell in its own step): it makes
    its socket's private directory, imports at once with no stdin (srun gives a task none),
    serves one client after another, and on SIGTERM (a time limit signals every step at once)
    waits for the worker it forked to end before it ends 0 and removes its directory. The
    directory is the node's own (its name ends in Slurm's name for the node): nodes may share /tmp."""
    sock = tmp_path / "warm-node-a" / "warm.sock"
    assert resident_socket(str(tmp_path / "warm"), {"SLURMD_NODENAME": "node-a"}) == str(sock)
    assert resident_socket(str(tmp_path / "warm"), {"SLURMD_NODENAME": "node-b"}) != str(sock)
    template = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--resident", str(tmp_path / "warm")],
                                env=env_for(SLURMD_NODENAME="node-a"),
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert "ready in" in template.stderr.readline()  # no client asked: it imported at once
        assert (sock.parent.stat().st_mode & 0o777) == 0o700
        (tmp_path / "echo.py").write_text(ECHO)
        for code in ("3", "5"):  # clients come and go; it stays
            proc = client(sock, tmp_path / "echo.py", code)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == int(code) and json.loads(out)["ppid"] == template.pid
        proc, worker = sleeper(tmp_path, sock)
        template.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert template.poll() is None and not gone(worker)  # the worker still has its stop to do
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        assert template.wait(timeout=30) == 0
        assert not sock.parent.exists()
    finally:
        if template.poll() is None:
            template.kill()


def test_a_resident_template_refuses_a_directory_others_may_enter(tmp_path):
    """Its socket's directory must be this user's alone: one that others may write to could
    hold another user's socket, which would be sent our workers' environment."""
    folder = tmp_path / "shared-node-a"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    result = subprocess.run([sys.executable, "-m", "trainer.warm", "--resident", str(tmp_path / "shared")],
                            env=env_for(SLURMD_NODENAME="node-a"), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "is not a directory of this user's alone (mode drwxr-xr-x" in result.stderr
    assert not (folder / "warm.sock").exists()


def test_the_socket_appears_only_once_it_listens(tmp_path, monkeypatch):
    """A client that connects to a socket bound but not yet listening is refused, and a refusal
    sends it cold (the template is gone): the path must not exist until the template listens.
    The kernel's own refusal is the oracle: a connect at the moment of `listen`."""
    from trainer import warm

    path = str(tmp_path / "warm.sock")
    seen = []
    real_listen = socket.socket.listen

    def listen(self, *args):
        seen.append(warm._connect(path) if os.path.exists(path) else "absent")
        return real_listen(self, *args)

    monkeypatch.setattr(warm, "CONNECT_WAIT_S", 0.0)
    monkeypatch.setattr(socket.socket, "listen", listen)
    listener = warm._listen(path, resident=False)
    try:
        assert seen == ["absent"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)  # listening now, under its name
        assert sorted(p.name for p in tmp_path.iterdir()) == ["warm.sock"]
    finally:
        listener.close()


# -- the launcher's choice ---------------------------------------------------------------------
def test_the_built_in_trainer_starts_warm_and_a_script_cold_unless_asked():
    trainer, script = JobSettings(), JobSettings(entry=["train.py"], script="train.py")
    assert warm_start({}, trainer) and not warm_start({}, script)
    assert warm_start({"DDPKIT_WARM": "1"}, script) and not warm_start({"DDPKIT_WARM": "0"}, trainer)
    assert not warm_start({}, JobSettings(warm_restarts=False))
    preflight = JobSettings(entry=["-m", "trainer.preflight", "--then", *TRAINER_ENTRY])
    assert warm_start({}, preflight)
    with pytest.raises(LaunchError, match=r"DDPKIT_WARM='yes' must be 0 \(cold restarts\) or 1"):
        warm_start({"DDPKIT_WARM": "yes"}, trainer)


def test_a_warm_plan_has_torchrun_start_the_client_before_the_entry():
    env = {"DDPKIT_NPROC_PER_NODE": "2"}
    warm, cold = plan_launch(env, python=PY, warm=True), plan_launch(env, python=PY)
    assert warm.warm and not cold.warm
    assert warm.argv[-4:] == ["-m", "trainer.warm", *TRAINER_ENTRY] and cold.argv[-2:] == list(TRAINER_ENTRY)
    assert warm.argv[:-4] == cold.argv[:-2]
    assert any("warm restarts" in n for n in warm.notes)
    srun = plan_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                        "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1",
                        "DDPKIT_LAUNCHER": "srun"}, python=PY, warm=True)
    assert not srun.warm and "trainer.warm" not in srun.argv  # srun starts every worker itself


def test_a_bad_warm_setting_stops_the_launcher_with_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: x\n")
    result = subprocess.run([sys.executable, "-m", "trainer.launch"], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DDPKIT_JOB_FILE": str(job),
                                 "DDPKIT_WARM": "sometimes"})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line == "ddpkit launch: DDPKIT_WARM='sometimes' must be 0 (cold restarts) or 1 (warm restarts)"


def test_a_template_no_worker_asked_for_ends_with_its_stdin_without_importing(tmp_path):
    """The imports wait for the first client: a launcher that ends first (torchrun failed to
    start, a refused plan) leaves a template that just exits."""
    template = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", str(tmp_path / "t.sock")],
                                env=env_for(), stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "t.sock").exists(), 30, "the socket")
    template.stdin.close()
    assert template.wait(timeout=30) == 0
    assert template.stderr.read() == ""  # no "ready" line: nothing was imported


def test_a_launcher_uses_its_allocations_resident_template_only_when_it_answers(tmp_path, monkeypatch):
    """DDPKIT_WARM_RESIDENT (the batch shell's, restarts inside a Slurm allocation): a socket
    that answers, in a directory of this user's alone, is used; none in time, a directory
    others may enter or a socket nobody serves any more: the launcher starts its own, and says so."""
    monkeypatch.setattr(supervise, "RESIDENT_WAIT_S", 0.3)
    said: list[str] = []
    assert supervise.resident_template(None, said.append) is None and said == []
    folder = tmp_path / "warm"
    folder.mkdir(mode=0o700)
    sock = folder / "warm.sock"
    assert supervise.resident_template(str(sock), said.append) is None
    assert said[-1].endswith(f"(no socket at {sock}): this node starts its own")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock))
    server.listen(1)
    assert supervise.resident_template(str(sock), said.append) == str(sock)
    assert "forked from the allocation's template" in said[-1]
    folder.chmod(0o750)
    assert supervise.resident_template(str(sock), said.append) is None and "not a directory of this user's" in said[-1]
    folder.chmod(0o700)
    server.close()  # the file stays: a template that died
    assert supervise.resident_template(str(sock), said.append) is None and "Connection refused" in said[-1]
