"""trainer/rank_lines.py on real processes: a worker's lines come out with its rank, each
stream in its order, the unfinished last line too, after the worker is gone; the launcher's
search for a node's ranks does not take the relay for a rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import REPO
from trainer.contract import STOP_FILE_VAR
from trainer.launch import script_stop

WORKER = """
import os, sys, time
from trainer import rank_lines
assert rank_lines.wanted(os.environ)
rank_lines.start(int(os.environ["RANK"]))
print("one", flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.stdout.write("bar 10%\\r"); sys.stdout.flush()
sys.stdout.write("bar 20%\\r\\n"); sys.stdout.flush()
print("[rank3]: torch's own prefix", flush=True)
os.system("echo from a child process")
sys.stdout.write("no newline at the end"); sys.stdout.flush()
if os.environ.get("HOLD"):
    print("holding", flush=True)
    time.sleep(60)
"""


def worker(tmp_path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "WORLD_SIZE": "4", "RANK": "3",
                                                         STOP_FILE_VAR: str(tmp_path / "stop"), **env})


def test_every_line_starts_with_the_rank_in_its_streams_order():
    proc = subprocess.run([sys.executable, "-c", WORKER], cwd=REPO, capture_output=True, timeout=60,
                          env={**os.environ, "WORLD_SIZE": "4", "RANK": "3"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode() == ("[rank3]: one\n[rank3]: bar 10%\r[rank3]: bar 20%\r\n"
                                    "[rank3]: torch's own prefix\n[rank3]: from a child process\n"
                                    "[rank3]: no newline at the end\n")
    assert proc.stderr.decode() == "[rank3]: to stderr\n"


def test_one_rank_or_the_switch_leaves_lines_alone():
    from trainer import rank_lines

    assert not rank_lines.wanted({"WORLD_SIZE": "1", "RANK": "0"})
    assert not rank_lines.wanted({"WORLD_SIZE": "2", "RANK": "0", "DDPKIT_RANK_LINES": "0"})
    assert rank_lines.wanted({"WORLD_SIZE": "2", "RANK": "0"})


def test_the_relay_is_no_rank_to_the_stop_and_writes_the_last_lines_of_a_killed_worker(tmp_path):
    proc = worker(tmp_path, HOLD="1")
    assert proc.stdout.readline() == b"[rank3]: one\n"
    while b"holding" not in proc.stdout.readline():
        pass
    found = script_stop.workers(str(tmp_path / "stop"))
    assert found == [(3, proc.pid)], found  # the worker, not its relay (the same environment)
    relays = [int(p) for p in os.listdir("/proc") if p.isdigit() and _comm(p) == "ddpkit-lines"
              and _ppid(p) == proc.pid]
    assert len(relays) == 1
    proc.kill()  # as the stop's SIGKILL: the relay drains what was written and ends
    proc.wait(10)
    assert proc.stdout.read() == b""  # everything before the kill came out already
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{relays[0]}") and _state(relays[0]) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{relays[0]}") or _state(relays[0]) == "Z"


def _comm(pid) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def _ppid(pid) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def _state(pid) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
