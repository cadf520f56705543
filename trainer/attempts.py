"""What every attempt leaves in the run directory for `ddpkit why` (deploy/why.py): stdlib only.

    RUN_DIR/attempts/attempt-N.json     rank 0's progress record (trainer/progress.py): its state
    RUN_DIR/attempts/errors/*.json      a worker's uncaught exception (`record_exception`)
    RUN_DIR/attempts/launch/*.json      a node's launcher (`LaunchRecord`): torchrun's exit, every
                                        worker failure torchrun reported, the output's last lines
    RUN_DIR/debug/attempt-N/verdict.txt the hang watchdog's verdict (trainer/watchdog.py)

torchrun reports each worker that fails, on its stderr, as it sees it, restarts included:
`failed (exitcode: -9) local_rank: 1 (pid: 4242) of binary: ...` (torch's
`elastic/multiprocessing/api.py`); a negative exit code is the signal that ended the worker.
The launcher (trainer/launch/supervise.py `supervise`) passes torchrun's stderr through and keeps those.
A worker killed by a signal writes nothing itself; one that raises writes its exception first.
All files are written whole by rename, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

from trainer.contract import workdir_record

ATTEMPTS_DIR = "attempts"
ERRORS_DIR = "errors"
LAUNCH_DIR = "launch"
TAIL_LINES = 40
#: torchrun's line for a failed worker (torch 2.x elastic/multiprocessing/api.py)
FAILED_WORKER = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
#: the rank and exit lines of each entry of torchrun's failure table (ChildFailedError, printed
#: when it ends): the line above names only the failure with the smallest timestamp, and those
#: are whole seconds, so a rank whose peer's death made it raise in the same second can be named
#: instead of the rank that died; the table lists every worker that failed.
TABLE_RANK = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: (\d+)\)")
TABLE_EXIT = re.compile(r"^\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)")
#: the launcher's line when its memory cgroup counted OOM kills (a log says so too)
OOM_LINE = "the OOM killer ended"
#: An exception that says only that another rank went away (gloo's and NCCL's words, c10d's):
#: the consequence of the rank that died, never the cause.
PEER_GONE = re.compile(r"Connection (reset|closed)|remote worker|Broken pipe|DistNetworkError|"
                       r"DistBackendError|peer|NCCL communicator was aborted|Socket Timeout", re.IGNORECASE)
#: How much later than it happened torchrun's error file dates an exception that only says a
#: peer went away (`postdate_error_file`).
CONSEQUENCE_LATER_S = 60


def run_directory(output_dir: str, run_id: str) -> Path:
    """`<output_dir>/<run id>`: the run id is `DDPKIT_RUN_ID`, else the job name."""
    from trainer.contract import RUN_ID_VAR

    return Path(output_dir) / (os.environ.get(RUN_ID_VAR) or run_id)


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def postdate_error_file(path: str | None, seconds: int) -> None:
    """Date torchrun's error file `seconds` later. torchrun names the failure with the smallest
    timestamp, in whole seconds, first: in its `failed (exitcode ...)` line (the only one when it
    restarts the group) and as the root cause of its summary. A worker killed by a signal leaves
    no error file and is dated when torchrun notices it; its peer, whose collective then broke,
    raises a moment earlier than that when a second ticks over in between, and would be named
    instead. Dated later, the consequence comes after the rank that died."""
    if not path:
        return
    try:
        data = json.loads(Path(path).read_text())
        info = data["message"]["extraInfo"]
        info["timestamp"] = str(int(info["timestamp"]) + seconds)
        Path(path).write_text(json.dumps(data))
    except (OSError, ValueError, KeyError, TypeError):
        return


def signal_name(exitcode: int) -> str | None:
    """`SIGKILL` for -9 (a child's return code) or 137 (a shell's 128+9); None otherwise."""
    number = -exitcode if exitcode < 0 else exitcode - 128 if 128 < exitcode < 160 else None
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def _library(filename: str) -> bool:
    """A frame of an installed package or of Python's own library (not the user's code)."""
    import sysconfig

    if filename.startswith("<") or "/site-packages/" in filename or "/dist-packages/" in filename:
        return True
    return any(filename.startswith(sysconfig.get_paths()[key] + os.sep) for key in ("stdlib", "platstdlib"))


def where_raised(frames: list[traceback.FrameSummary]) -> str | None:
    """`FILE:LINE in FUNC` of the innermost frame of the user's own code (outside site-packages
    and the standard library: the line to look at), with the library frame that raised after it
    where they differ: `train.py:89 in main (in .../torch/cuda/__init__.py:689 in set_device)`."""
    if not frames:
        return None
    said = [f"{f.filename}:{f.lineno} in {f.name}" for f in frames]
    own = next((i for i in range(len(frames) - 1, -1, -1) if not _library(frames[i].filename)), None)
    if own is None or own == len(frames) - 1:
        return said[-1]
    return f"{said[own]} (in {said[-1]})"


def record_exception(run_dir: Path, rank: int, exc: BaseException, *, step: int | None,
                     phase: str | None) -> None:
    """A worker's uncaught exception, for `ddpkit why` (never raises: the exception itself
    must still reach torchrun)."""
    frames = traceback.extract_tb(exc.__traceback__)
    record = {
        "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "type": type(exc).__name__, "message": str(exc).strip()[:2000], "step": step, "phase": phase,
        "where": where_raised(frames),
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
    }
    try:
        write_json(run_dir / ATTEMPTS_DIR / ERRORS_DIR / f"rank-{rank}-{os.getpid()}.json", record)
    except OSError:
        pass


def oom_kills(cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """How many processes the kernel's OOM killer ended in this process's memory cgroup (a
    container's, a Slurm job's, a pod's): `oom_kill` of cgroup v2's memory.events or v1's
    memory.oom_control. None where neither is readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    places = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            places.append(Path(cgroup_root) / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            places.append(Path(cgroup_root) / "memory" / path.lstrip("/") / "memory.oom_control")
            places.append(Path(cgroup_root) / "memory" / "memory.oom_control")  # a container's own mount
    for place in places:
        try:
            for line in place.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


class LaunchRecord:
    """One node's launcher: fed torchrun's stderr line by line, written when torchrun ends.
    It also counts the OOM killer's kills in its memory cgroup meanwhile (`oom_kills`): a
    worker that died of SIGKILL is then known to be out of memory, not kill -9."""

    def __init__(self, run_dir: Path | None, node_rank: int, nproc: int) -> None:
        self.run_dir, self.node_rank, self.nproc = run_dir, node_rank, nproc
        self.ooms_before = oom_kills()
        self.oom_kills = 0  # counted by `write`
        self.started = time.time()
        self.failures: list[dict[str, Any]] = []
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._table_local: int | None = None  # the failure table's entry being read (`feed`)
        self.template_pid: int | None = None  # the warm path's template (trainer/warm.py)

    def feed(self, line: str) -> None:
        self.tail.append(line.rstrip("\n")[:1000])
        found = FAILED_WORKER.search(line)
        if found:
            self.failed(int(found.group(2)), int(found.group(1)), int(found.group(3)))
            return
        found = TABLE_RANK.search(line)
        if found:
            self._table_local = int(found.group(2))
            return
        found = TABLE_EXIT.search(line)
        if found and self._table_local is not None:
            self.failed(self._table_local, int(found.group(1)), int(found.group(2)))
            self._table_local = None

    def failed(self, local: int, code: int, pid: int) -> None:
        """A worker torchrun saw fail (once per process: the first line and the table both name it)."""
        if any(f["pid"] == pid and f["local_rank"] == local for f in self.failures):
            return
        self.failures.append({"time": time.time(), "local_rank": local,
                              "rank": self.node_rank * self.nproc + local, "exitcode": code,
                              "signal": signal_name(code), "pid": pid})

    def write(self, torchrun_exit: int | None, exit_code: int, refused: str | None = None) -> Path | None:
        """The record; `refused`: why the launcher itself ended before torchrun (or its
        workers) ran, in its own words (torchrun_exit None)."""
        if self.run_dir is None:
            return None
        path = self.run_dir / ATTEMPTS_DIR / LAUNCH_DIR / f"{socket.gethostname()}-{os.getpid()}.json"
        record = {"host": socket.gethostname(), "pid": os.getpid(), "node_rank": self.node_rank,
                  "nproc": self.nproc, "started": self.started, "ended": time.time(),
                  "torchrun_exit": torchrun_exit, "exit": exit_code, "failures": self.failures,
                  "tail": list(self.tail), **({"refused": refused} if refused else {}),
                  **({"template_pid": self.template_pid} if self.template_pid else {}),
                  **({"workdir": workdir} if (workdir := workdir_record(os.environ)) else {})}
        ooms = oom_kills()
        if ooms is not None and self.ooms_before is not None and ooms > self.ooms_before:
            record["oom_kills"] = self.oom_kills = ooms - self.ooms_before
        try:
            write_json(path, record)
        except OSError:
            return None
        return path


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every JSON record in `directory`, oldest first (by their `time` or `started`)."""
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            out.append(record)
    return sorted(out, key=lambda r: r.get("time", r.get("started", 0.0)))


def read_verdicts(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The hang watchdog's verdicts by attempt."""
    out = {}
    for path in (run_dir / "debug").glob("attempt-*/verdict.txt"):
        try:
            found, _ = json.JSONDecoder().raw_decode(path.read_text())
            out[int(path.parent.name.split("-", 1)[1])] = found
        except (OSError, ValueError, IndexError):
            continue
    return out
