"""What `ddpkit status` adds after the state: the trainer's progress record, read where each
target keeps it, as one line or as JSON.

The trainer's rank 0 keeps the record (`trainer/progress.py`): `RUN_DIR/attempts/attempt-N.json`,
and a `ddpkit-progress {json}` line in its output at most every 10 s. `ddpkit status` reads it
with the permissions the user already has: the run directory for a local run, the job's
output file on Slurm (`StdOut`), rank 0's pod log on Kubernetes. A job whose trainer is not
ddpkit's (`script:`) has no record; its status is the state alone.

    RUNNING  step 120/500 (24%)  epoch 1/5  850 samples/s  ETA 7m12s  goodput 91%  restarts 1/3  (4s ago)

and, when the trainer names one (trainer/stragglers.py), `straggler: rank 1 on node-b 2.4x slower`
before the age.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.errors import UserError
from trainer.progress import attempt_files, last_record, read_record
from trainer.stragglers import describe as describe_straggler

__all__ = ["TAIL_LINES", "Report", "RunDir", "duration", "is_run_dir", "last_record", "tail_of_file"]

#: How much of the end of a log `status` reads for the newest record (the trainer prints one at
#: least every 10 s, so it is in the last lines unless a user's code floods the log).
TAIL_BYTES = 256 * 1024
TAIL_LINES = 2000


def duration(seconds: float) -> str:
    """`7m12s`, `2h05m`, `3d04h`: an ETA or an age, to the unit that matters."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def step_of(record: dict[str, Any]) -> str:
    """`120/500`, or `120` where the total is unknown (a script job without `steps:`)."""
    total = record.get("total_steps")
    return f"{record.get('step', 0)}/{total}" if total else f"{record.get('step', 0)}"


def progress_text(record: dict[str, Any], now: float | None = None) -> str:
    """The part of the status line after the state."""
    now = time.time() if now is None else now
    step, total = record.get("step", 0), record.get("total_steps") or 0
    parts = [f"step {step_of(record)}" + (f" ({100 * step // total}%)" if total else "")]
    if record.get("epochs"):
        parts.append(f"epoch {min(record.get('epoch', 0) + 1, record['epochs'])}/{record['epochs']}")  # 1-based
    if record.get("samples_per_s"):
        parts.append(f"{record['samples_per_s']:.0f} samples/s")
    elif record.get("steps_per_s"):  # a script job: its samples per step are its own
        parts.append(f"{record['steps_per_s']:.2f} steps/s")
    if record.get("state") == "running" and record.get("eta_s") is not None:
        parts.append(f"ETA {duration(record['eta_s'])}")
    run_goodput = (record.get("run") or {}).get("goodput")
    if run_goodput is not None:
        parts.append(f"goodput {100 * run_goodput:.0f}%")
    parts.append(f"restarts {record.get('restarts', 0)}/{record.get('restarts_allowed', 0)}")
    if record.get("straggler"):
        parts.append(f"straggler: {describe_straggler(record['straggler'])}")
    if record.get("state") == "running":
        parts.append(f"({duration(now - record.get('updated', now))} ago)")
    return "  ".join(parts)


@dataclass(frozen=True)
class Report:
    """What `ddpkit status` shows of one job: the state line (`describe`), the trainer's newest
    progress record, and how long the job waited to start (where the scheduler says)."""

    state_line: str
    record: dict[str, Any] | None = None
    waited_s: float | None = None
    workdir: dict[str, Any] | None = None  # the tree a `workdir:` job runs, where the target keeps it

    @property
    def state(self) -> str:
        return self.state_line.split()[0]

    def text(self, now: float | None = None) -> str:
        out = f"{self.state_line}  {progress_text(self.record, now)}" if self.record else self.state_line
        return out + (f"  waited {duration(self.waited_s)} to start" if self.waited_s is not None else "")

    def as_json(self, handle: str) -> dict[str, Any]:
        """`ddpkit status --json`: the state, the target's words, the record (null without one)."""
        _, _, detail = self.state_line.partition(" ")
        return {"handle": handle, "state": self.state, "detail": detail.strip().strip("()") or None,
                "waited_s": self.waited_s, "progress": self.record,
                "workdir": self.workdir or (self.record or {}).get("workdir")}


def tail_of_file(path: Path, size: int = TAIL_BYTES) -> str:
    """The last `size` bytes of a file as text ("" when it cannot be read)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


# -- a local run: the run directory is the handle -----------------------------------------

def newest_attempt(run_dir: Path) -> dict[str, Any] | None:
    files = attempt_files(run_dir)
    return read_record(files[-1]) if files else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_state(record: dict[str, Any]) -> str:
    """A local run's state from its newest attempt record: an attempt that ended on its own
    says so; a running one whose rank 0 is gone is RESTARTING while its torchrun agent lives
    (it restarts the group), else FAILED. On another host the record is all there is."""
    state = record.get("state")
    if state == "completed":
        return "SUCCEEDED"
    if state == "stopped":
        return f"CANCELLED (stopped at step {record.get('step')} after a checkpoint)"
    if state in ("failed", "hung"):
        agent = _alive(int(record.get("agent_pid", 0) or 0)) and record.get("host") == socket.gethostname()
        return (f"RESTARTING (attempt {record.get('attempt')} failed; torchrun restarts the group)" if agent
                else f"FAILED (attempt {record.get('attempt')} failed at step {record.get('step')}: see its output)")
    if record.get("host") != socket.gethostname():
        return f"RUNNING (on {record.get('host')}: not checked from here)"
    if _alive(int(record.get("pid", 0) or 0)):
        return "RUNNING"
    if _alive(int(record.get("agent_pid", 0) or 0)):
        return f"RESTARTING (attempt {record.get('attempt')} ended; torchrun restarts the group)"
    return f"FAILED (attempt {record.get('attempt')} ended without finishing: see its output)"


def is_run_dir(text: str) -> bool:
    """A local run's directory (`ddpkit status runs/quickstart`), not a cluster handle."""
    return "://" not in text and Path(text).is_dir()


class RunDir:
    """A local run, addressed by its run directory (`train.output_dir`/NAME), with the verbs of
    a submitted job that make sense for it."""

    def __init__(self, path: str):
        self.path = Path(path)

    def _record(self) -> dict[str, Any]:
        record = newest_attempt(self.path)
        if record is None:
            raise UserError(f"{self.path}: no attempt records (RUN_DIR/attempts/): not a run "
                            "directory of ddpkit's trainer, or its first step has not come yet")
        return record

    def describe(self, handle: str) -> str:
        return local_state(self._record())

    def report(self, handle: str) -> Report:
        record = self._record()
        return Report(local_state(record), record)

    def why(self, handle: str) -> list[str]:
        from deploy.why import explain

        return explain("", "", self.path)

    def tend(self, handle: str, ended: bool) -> list[str]:
        """Nothing to look after beside reading: a local run has no nodes to keep it off."""
        return []

    def logs(self, handle: str, *, query: Any = None, follow: bool = False, out: Any = None,
             poll_s: float = 1.0) -> int:
        """The lines `query` asks for (deploy/logs.py) of the output `ddpkit run --local` kept in
        RUN_DIR/output.log, tagged as a Slurm node's lines are; with `follow`, until the run ends."""
        import sys

        from deploy.logs import LineWriter, Query, pick_tagged, print_file

        path = self.path / "output.log"
        if not path.exists():
            raise UserError(f"{self.path}: no output.log: `ddpkit run --local` keeps the trainer's "
                            "output there (a run by another command, or of a `script:`, printed it only)")
        query = query or Query()
        return print_file(path, LineWriter(out or sys.stdout, pick_tagged(query)), query, follow=follow,
                          poll_s=poll_s, missing=f"{path}: not there",
                          ended=lambda: self.describe(handle).split()[0] in ("SUCCEEDED", "FAILED", "CANCELLED"))

    def cancel(self, handle: str, **_: Any) -> None:
        pid = (newest_attempt(self.path) or {}).get("agent_pid")
        raise UserError(f"{self.path}: stop a local run where it runs (Ctrl-C), or `kill -TERM {pid}` "
                        "(its torchrun agent: the workers checkpoint and stop)")
