"""How far a run got and where its time went: the goodput ledger and the progress record.

Rank 0 keeps one **ledger** per attempt (an attempt: one start of the training processes, the
first one or a restart by torchrun, a Slurm requeue or a new pod). Every moment of an attempt
belongs to exactly one class of `CLASSES`, so the classes add up to the attempt's wall time by
construction: the trainer says which class it enters (`Ledger.enter`, `Ledger.during`) and the
ledger books the time since the last change to the class it leaves.

The **progress record** is the ledger plus the position (step, epoch, samples/s, ETA,
restarts). Rank 0 rewrites `RUN_DIR/attempts/attempt-N.json` (atomically) at most once a
second, and the step count alone in `attempt-N.step` after every step (one 12-byte `pwrite`:
the furthest step of an attempt that dies between two records, which the next attempt books
as `redone` when it does those steps again), and prints the record as one `ddpkit-progress {json}` line at most every `PRINT_EVERY_S`, so
`ddpkit status` reads it without any permission a user lacks: from the run directory (local),
the job's output file (Slurm) or rank 0's pod log (Kubernetes). The record also carries the
run so far (`run`: every earlier attempt's classes, plus `between_attempts`), read from the
earlier attempts' files when the run directory outlives an attempt (a shared file system, a
volume: the same place a resume needs).

What the trainer cannot see, the target adds where it tells: `ddpkit status` reads the time a
job waited to be scheduled or admitted (and, on Kubernetes, the container's start and image
pull) from the scheduler. `hang` is what the hang watchdog (trainer/watchdog.py) found.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.contract import workdir_record
from trainer.forked import FORKED
from trainer.kubeflow_status import StatusReporter

#: An attempt's classes, in the order they usually come.
CLASSES = {
    "startup": "launch to `import torch` done: the node's launcher, torchrun, the interpreter, imports",
    "rendezvous": "forming the process group",
    "setup": "model, optimizer, data and DDP",
    "checkpoint_load": "finding and reading the checkpoint resumed from",
    "productive": "training steps (data loading included) beyond the furthest step of any earlier attempt",
    "redone": "training steps an earlier attempt had done already: work lost to a restart",
    "checkpoint_save": "the blocking part of checkpoint saves (a background write does not block)",
    "eval": "evaluation",
    "hang": "a stuck rank, as the hang watchdog found it: from the stuck phase's start to the verdict",
    "stop": "after a stop request: the final checkpoint and the way out",
    "finish": "after the last step of a completed run: the summary, the last evaluation's bookkeeping",
}
#: The run's classes: an attempt's, and the time between attempts.
RUN_CLASSES = {
    **CLASSES,
    "between_attempts": "from an attempt's last record to the next attempt's start: the failure's "
                        "detection, teardown, the restart or requeue, and the failed attempt's "
                        "unrecorded last second",
}
PREFIX = "ddpkit-progress "
WRITE_EVERY_S = 1.0  # the attempt file
PRINT_EVERY_S = 10.0  # the log line
ATTEMPTS_DIR = "attempts"


class Ledger:
    """Seconds per class of one attempt since `t0` (a `time.time()`)."""

    def __init__(self, t0: float, phase: str = "startup") -> None:
        self.t0 = t0
        self.phase = phase
        self.since = t0
        self.seconds = dict.fromkeys(CLASSES, 0.0)

    def enter(self, phase: str, at: float | None = None) -> str:
        """Book the time since the last change to the current class; `phase` from now (or
        from `at`). The class left."""
        now = time.time() if at is None else at
        left = self.phase
        self.seconds[left] += now - self.since
        self.phase, self.since = phase, now
        return left

    def rebook(self, seconds: float, to: str) -> None:
        """Move the last `seconds` of the current class to `to` (the watchdog's `hang`)."""
        seconds = max(0.0, min(seconds, time.time() - self.since))
        self.seconds[to] += seconds
        self.since += seconds

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        left = self.enter(phase)
        try:
            yield
        finally:
            self.enter(left)

    def snapshot(self, now: float) -> dict[str, float]:
        """The classes as of `now`, the open interval of the current class included."""
        seconds = dict(self.seconds)
        seconds[self.phase] += now - self.since
        return seconds


def attempt_files(run_dir: Path) -> list[Path]:
    """The run's attempt records, oldest first."""
    found = (run_dir / ATTEMPTS_DIR).glob("attempt-*.json")
    return sorted(found, key=lambda p: int(p.stem.split("-", 1)[1]) if p.stem.split("-", 1)[1].isdigit() else -1)


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_totals(earlier: list[dict[str, Any]]) -> tuple[dict[str, float], float, int]:
    """What the earlier attempts add to a run: their classes summed (with the gaps between
    them as `between_attempts`), the last one's `updated` time, and their furthest step."""
    totals = dict.fromkeys(RUN_CLASSES, 0.0)
    last_updated, furthest = None, 0
    for record in earlier:
        for name, seconds in (record.get("classes") or {}).items():
            if name in totals:
                totals[name] += float(seconds)
        if last_updated is not None:
            totals["between_attempts"] += max(0.0, float(record["started"]) - last_updated)
        last_updated = float(record["updated"])
        furthest = max(furthest, int(record.get("furthest_step", record.get("step", 0))))
    return totals, last_updated or 0.0, furthest


def step_file_value(path: Path) -> int:
    """The step count in an attempt's `.step` file (0 when there is none)."""
    try:
        return int(path.read_bytes().strip() or 0)
    except (OSError, ValueError):
        return 0


def goodput(classes: dict[str, float]) -> float | None:
    wall = sum(classes.values())
    return classes.get("productive", 0.0) / wall if wall > 0 else None


class Exporter:
    """The record's numbers for Prometheus (prometheus-client), on rank 0: served on `port`
    (`/metrics`) and/or rewritten to `textfile` at every record. Gauges, not counters: a
    restarted attempt resumes from a checkpoint, so the step can go back."""

    def __init__(self, run_id: str, *, port: int | None, textfile: Path | None) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry, self.run_id, self.textfile = CollectorRegistry(), run_id, textfile
        self.gauges = {name: Gauge(f"ddpkit_{name}", doc, ["run"], registry=self.registry)
                       for name, doc in EXPORTED.items()}
        self.seconds = Gauge("ddpkit_time_seconds", "The run's wall time so far, by goodput ledger class",
                             ["run", "class"], registry=self.registry)
        if textfile is not None:
            textfile.parent.mkdir(parents=True, exist_ok=True)
        if port:
            try:
                start_http_server(port, registry=self.registry)
            except OSError as e:
                from trainer.config import ConfigError

                raise ConfigError(f"train.prometheus_port: cannot serve on port {port} of "
                                  f"{socket.gethostname()} ({e.strerror}); pick another port") from None

    def update(self, record: dict[str, Any]) -> None:
        for name, gauge in self.gauges.items():
            value = record["run"]["goodput"] if name == "goodput" else record.get(name)
            if value is not None:
                gauge.labels(self.run_id).set(value)
        for name, seconds in record["run"]["classes"].items():
            self.seconds.labels(self.run_id, name).set(seconds)
        if self.textfile is not None:
            from prometheus_client import write_to_textfile

            write_to_textfile(str(self.textfile), self.registry)


#: What `Exporter` exports beside the time classes: `ddpkit_<name>`.
EXPORTED = {
    "step": "Optimizer steps done", "total_steps": "Optimizer steps the run will take",
    "epoch": "The current epoch", "samples_per_s": "Samples per second, all ranks, over the last steps",
    "loss": "Training loss of the last logged step", "eta_s": "Seconds to the last step at the current rate",
    "goodput": "Productive training time / the run's wall time so far",
    "restarts": "Restarts used so far", "restarts_allowed": "Restarts the job allows",
    "attempt": "The attempt (0: the first start)",
}


class Progress:
    """Rank 0's progress record for one attempt: `tick` after every step (cheap unless a write
    is due), `publish` at the end."""

    def __init__(self, run_dir: Path, ledger: Ledger, *, total_steps: int, epochs: int,
                 global_batch: int, restarts_allowed: int) -> None:
        self.dir = run_dir / ATTEMPTS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        earlier = [r for r in map(read_record, attempt_files(run_dir)) if r and "started" in r and "updated" in r]
        self.attempt = 1 + max((int(r.get("attempt", -1)) for r in earlier), default=-1)
        self.path = self.dir / f"attempt-{self.attempt}.json"
        self.earlier, self.earlier_end, furthest = run_totals(earlier)
        steps = (step_file_value(p.with_suffix(".step")) for p in attempt_files(run_dir))
        self.furthest = max(furthest, *steps) if earlier else furthest
        self.step_fd = os.open(self.path.with_suffix(".step"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        self.run_started = float(earlier[0]["started"]) if earlier else ledger.t0
        self.ledger = ledger
        self.total_steps, self.epochs, self.global_batch = total_steps, epochs, global_batch
        self.restarts_allowed = restarts_allowed
        self.recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, step) of recent steps
        self.written = self.printed = 0.0
        # A forked worker's parent is the template (trainer/warm.py): its client's is the agent.
        self.host, self.pid, self.agent_pid = socket.gethostname(), os.getpid(), int(FORKED.get("agent") or os.getppid())
        self.start = {"warm": True, "template_pid": int(FORKED["template"])} if FORKED else {"warm": False}
        self.loss: float | None = None  # the last logged step's (the trainer sets it)
        self.straggler: dict[str, Any] | None = None  # trainer/stragglers.py, set by the trainer
        self.ranks: list[dict[str, Any]] | None = None  # each rank's rate over the last window
        self.exporter: Exporter | None = None
        self.kubeflow = StatusReporter.from_env(os.environ)  # a TrainJob under Trainer's status server
        self.resumed: dict[str, Any] | None = None  # the checkpoint resumed from, those skipped
        self.lines = True  # print `ddpkit-progress` lines (where the log is how `status` reads it)
        self.workdir = workdir_record(os.environ)  # the tree a `workdir:` job runs

    def phase_of(self, step: int) -> str:
        """The class of a step that starts at `step` (done steps): redone up to the furthest."""
        return "redone" if step < self.furthest else "productive"

    def tick(self, step: int, epoch: int, *, force: bool = False) -> None:
        now = time.time()
        if self.recent and self.recent[-1][1] == step:
            self.recent[-1] = (now, step)
        else:
            self.recent.append((now, step))
            os.pwrite(self.step_fd, b"%12d" % step, 0)
        if force or now - self.written >= WRITE_EVERY_S:
            self.write(self.record(step, epoch, "running", now), print_line=force or now - self.printed >= PRINT_EVERY_S)

    def publish(self, step: int, epoch: int, state: str) -> dict[str, Any]:
        """The last record of an attempt that ended on its own (`completed` or `stopped`)."""
        record = self.record(step, epoch, state, time.time())
        self.write(record, print_line=True)
        return record

    def steps_per_s(self) -> float | None:
        if len(self.recent) < 2:
            return None
        (t_a, s_a), (t_b, s_b) = self.recent[0], self.recent[-1]
        return (s_b - s_a) / (t_b - t_a) if t_b > t_a and s_b > s_a else None

    def record(self, step: int, epoch: int, state: str, now: float) -> dict[str, Any]:
        classes = self.ledger.snapshot(now)
        run = {name: self.earlier.get(name, 0.0) + classes.get(name, 0.0) for name in RUN_CLASSES}
        if self.attempt:
            run["between_attempts"] += max(0.0, self.ledger.t0 - self.earlier_end)
        rate = self.steps_per_s()
        remaining = max(0, self.total_steps - step) if self.total_steps else None  # a script without `steps:`
        return {
            "attempt": self.attempt, "state": state, "host": self.host, "pid": self.pid,
            "agent_pid": self.agent_pid, "start": self.start, "started": self.ledger.t0, "updated": now,
            "step": step, "furthest_step": max(step, self.furthest), "total_steps": self.total_steps or None,
            "epoch": epoch, "epochs": self.epochs, "loss": self.loss,
            "samples_per_s": rate * self.global_batch if rate and self.global_batch else None,
            "steps_per_s": rate,
            "eta_s": (remaining / rate if remaining is not None and rate and state == "running"
                      else (0.0 if remaining == 0 else None)),
            "restarts": self.attempt, "restarts_allowed": self.restarts_allowed,
            "wall_s": now - self.ledger.t0, "classes": _rounded(classes),
            "straggler": self.straggler, "ranks": self.ranks, "resumed": self.resumed,
            **({"workdir": self.workdir} if self.workdir else {}),
            "run": {"started": self.run_started, "wall_s": now - self.run_started,
                    "goodput": goodput(run), "classes": _rounded(run)},
        }

    def write(self, record: dict[str, Any], *, print_line: bool) -> None:
        text = json.dumps(record, separators=(",", ":"))
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        self.written = record["updated"]
        if self.exporter is not None:
            self.exporter.update(record)
        if self.kubeflow is not None:
            self.kubeflow.offer(record)
        if print_line and self.lines:
            self.printed = record["updated"]
            print(PREFIX + text, flush=True)


def _rounded(classes: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds, 4) for name, seconds in classes.items()}


def last_record(text: str) -> dict[str, Any] | None:
    """The newest `ddpkit-progress` record in a log (lines may carry a launcher's prefix, such
    as torchrun's `[default0]:`)."""
    for line in reversed(text.splitlines()):
        at = line.find(PREFIX)
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(PREFIX):])
        except ValueError:
            continue  # a line cut short (the log's tail began inside it)
        if isinstance(record, dict):
            return record
    return None
