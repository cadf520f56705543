"""A stop of your own script (`script:`/`module:` jobs) that ends in seconds.

The built-in trainer answers a stop signal with a checkpoint and tells the launcher so
(`DDPKIT_STOP_FILE`); torchrun waits the whole stop grace (`--shutdown-timeout`) for it. A
script has no such protocol, and a rank blocked in a C++ collective (a hang, a peer gone) never
runs its SIGTERM handler, so torchrun would wait out the grace (120 s by default) for nothing.
So the launcher of a script job, `SCRIPT_STOP_S` (or the job's `DDPKIT_SCRIPT_STOP_S`) after the
stop signal it passed on, ends every
rank of its node still running (SIGKILL), except one whose Python stack (read from outside by
py-spy, the process untouched) shows a checkpoint being written (`torch.save`, Distributed
Checkpoint, safetensors): that one keeps the rest of the grace, as the trainer's stop would.
Every rank's stacks at the signal are in `RUN_DIR/debug/attempt-N/` already (trainer/guard.py
writes them at SIGTERM, before the script's own handler runs), so `ddpkit why` says where each
rank was.

A script that wants to save on a stop: handle SIGTERM (`signal.signal(signal.SIGTERM, ...)`:
set a flag, save at the end of the step, exit); the grace left is `DDPKIT_STOP_GRACE_S` less
what has passed. Frameworks' handlers keep working the same way (Lightning's).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer.contract import SCRIPT_STOP_S_VAR, STOP_FILE_VAR, warm_worker_file
from trainer.rank_lines import RELAY_NAME

#: Seconds after the stop signal before the ranks still running are ended.
SCRIPT_STOP_S = 5.0
#: Frames of a checkpoint being written.
SAVING = re.compile(r"torch/serialization\.py|torch/distributed/checkpoint/|safetensors/")


def workers(stop_file: str) -> list[tuple[int, int]]:
    """(global rank, pid) of this launcher's workers: the processes whose environment holds its
    own stop file and a `RANK` (torchrun's agent has the stop file, no rank), less each
    worker's line relay (trainer/rank_lines.py, a fork of the worker: the same environment),
    which must outlive its worker to write the last lines."""
    mine = f"{STOP_FILE_VAR}={stop_file}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if mine in env and Path(f"/proc/{pid}/comm").read_text().strip() != RELAY_NAME:
                rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
                if rank is not None:
                    found.append((int(rank), forked_worker(stop_file, int(pid))))
    return sorted(found)


def forked_worker(stop_file: str, pid: int) -> int:
    """The worker a warm template forked for the client `pid` (which published it: trainer/warm.py
    `_publish_worker`); `pid` itself for a worker torchrun started. A forked worker's
    environment in /proc is the template's: only its client is found by `RANK`."""
    try:
        return int(Path(warm_worker_file(stop_file, pid)).read_text())
    except (OSError, ValueError):
        return pid


def stacks(pids: list[int], timeout_s: float = 10.0) -> dict[int, str]:
    """Each process's Python stacks by py-spy (all at once; '' where py-spy could not read them)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    procs = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            procs[pid] = subprocess.Popen([spy, "dump", "--pid", str(pid), "--nonblocking"], text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = {}
    for pid, proc in procs.items():
        try:
            out[pid] = proc.communicate(timeout=timeout_s)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out[pid] = ""
    return out


def wait_s() -> float:
    """`SCRIPT_STOP_S`, or the job's `DDPKIT_SCRIPT_STOP_S`."""
    try:
        return max(0.0, float(os.environ.get(SCRIPT_STOP_S_VAR) or SCRIPT_STOP_S))
    except ValueError:
        return SCRIPT_STOP_S


def end_ranks(torchrun: subprocess.Popen, stop_file: str, log: Callable[[str], None]) -> None:
    """`wait_s()` after a stop: SIGKILL this node's ranks that still run and write no checkpoint."""
    waited = wait_s()
    deadline = time.monotonic() + waited
    while torchrun.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    running = workers(stop_file) if torchrun.poll() is None else []
    if not running:
        return
    read = stacks([pid for _, pid in running])
    ended = []
    for rank, pid in running:
        if SAVING.search(read.get(pid, "")):
            log(f"rank {rank} (pid {pid}) is writing a checkpoint {waited:.0f}s after the stop: "
                "it keeps the stop grace")
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            ended.append(rank)
    if ended:
        log(f"rank(s) {', '.join(map(str, ended))} still running {waited:.0f}s after the stop and "
            "writing no checkpoint: ended (SIGKILL); their stacks at the signal are in the run directory")


def on_stop(torchrun: subprocess.Popen, stop_file: str, log: Callable[[str], None]) -> None:
    """Start `end_ranks` beside the launcher's wait for torchrun."""
    threading.Thread(target=end_ranks, args=(torchrun, stop_file, log), name="ddpkit-script-stop",
                     daemon=True).start()
