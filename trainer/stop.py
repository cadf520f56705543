"""A graceful stop: a stop signal is remembered (`StopRequest`), the ranks agree at a step
boundary to stop at the same step (`StopVote`, `stop_here`), and the trainer writes its stop
checkpoint there; a stop no step boundary acts on in time exits `EXIT_STOPPED_UNSAVED` (137).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Any

from trainer.contract import (
    DEFAULT_STOP_GRACE_S,
    EXIT_STOPPED_UNSAVED,
    STOP_AT_STEP_VAR,
    STOP_GRACE_S_VAR,
)

STOP_SIGNALS = ("SIGTERM", "SIGUSR2", "SIGINT")
# A stop signal no step boundary acted on within half the target's grace period (SIGTERM to
# SIGKILL, DDPKIT_STOP_GRACE_S, default DEFAULT_STOP_GRACE_S): exit EXIT_STOPPED_UNSAVED (137)
# anyway, with no checkpoint of that moment (a collective waits for a lost rank).
STOP_GRACE_S = float(os.environ.get(STOP_GRACE_S_VAR) or DEFAULT_STOP_GRACE_S) / 2


class StopRequest:
    """Remembers a stop signal; the loop acts on it at the next step boundary.

    A second SIGINT (Ctrl-C twice) interrupts at once. Python runs signal handlers only
    between bytecodes, so a rank blocked in C++ (`init_process_group` waiting for its peers, a
    collective waiting for a lost rank) would sit out the whole `train.timeout_s`. A watcher
    thread learns of the signal at once (`signal.set_wakeup_fd`): before training starts
    (process group, setup, resume: nothing new to save) the rank exits `EXIT_STOPPED_UNSAVED`
    (137) right away; during training it exits 137 when no step boundary acts on the signal
    within `STOP_GRACE_S` (half the target's grace period). 143 (`EXIT_STOPPED`) is only for a
    stop whose checkpoint was written (`Trainer.train`).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.after_step = int(os.environ.get(STOP_AT_STEP_VAR) or 0)  # fault injection for tests
        self.phase = "starting"  # starting (process group, setup) | training (the loop and after)
        self.acted = threading.Event()  # the loop decided to stop: it checkpoints, however long

    def install(self) -> None:
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), self._handle)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="ddpkit-stop", daemon=True).start()

    def _watch(self, read_fd: int) -> None:
        stops = {int(getattr(signal, name)) for name in STOP_SIGNALS}
        while not any(b in stops for b in os.read(read_fd, 64)):
            pass
        if self.phase == "starting":
            self._exit("before training started (joining the process group or setting up)")
        if not self.acted.wait(STOP_GRACE_S):
            self._exit(f"and no step boundary acted on it within {STOP_GRACE_S:.0f}s (a collective "
                       "waiting for a lost rank?); the last checkpoint stands")

    def _exit(self, why: str) -> None:
        # No checkpoint of this moment was written: EXIT_STOPPED_UNSAVED, not EXIT_STOPPED (that
        # one promises a checkpoint, CONTRACT.md), and no DDPKIT_STOP_FILE (trainer.launch
        # reads it as "the stop checkpoint exists").
        say(f"stop signal {why}: exiting {EXIT_STOPPED_UNSAVED}")
        os._exit(EXIT_STOPPED_UNSAVED)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def requested(self, step: int) -> bool:
        return self.signum is not None or (0 < self.after_step <= step)


class StopVote:
    """All ranks agree to stop at the same step boundary, soon after any of them was signalled.

    A vote is an asynchronous MAX all-reduce on a CPU (gloo) group, started at one step boundary
    and read at the next, so it never blocks the GPU stream or adds latency. It carries three
    numbers: stop (a rank was signalled), the slowest rank's mean step in microseconds since the
    last vote, and exact (a rank has `DDPKIT_STOP_AT_STEP`). Every rank reads the same result and
    so starts the next vote at the same boundary: `steps_between(...)` steps after the last one,
    about `VOTE_EVERY_S` apart (at most `MAX_STEPS_BETWEEN` steps), and every step while steps
    take longer than that, or when `exact`. A signal is acted on within about
    `VOTE_EVERY_S` plus a step; fast steps (a small model, many ranks over gloo) do not pay
    for a collective each. `DDPKIT_STOP_AT_STEP=N` stops after step N + 1, as a signal at step
    N did when every step voted.
    """

    VOTE_EVERY_S = 0.2
    MAX_STEPS_BETWEEN = 20

    def __init__(self, group: Any, distributed: bool, exact: bool = False):
        self.group, self.distributed, self.exact = group, distributed, exact
        self.pending: Any = None
        self.buf: Any = None
        self.boundary = 0  # step boundaries seen
        self.started_at = 0  # the boundary of the last vote started
        self.next_at = 1  # the boundary of the next vote
        self.t_started: float | None = None  # perf_counter of the last vote started

    @classmethod
    def steps_between(cls, step_us: int, exact: bool) -> int:
        """Steps from one vote to the next, from the slowest rank's mean step (0: not known)."""
        if exact or step_us <= 0:
            return 1
        return max(1, min(cls.MAX_STEPS_BETWEEN, math.ceil(cls.VOTE_EVERY_S * 1e6 / step_us)))

    def poll(self, requested: bool) -> bool:
        """At a step boundary: True when the ranks agreed to stop here."""
        if not self.distributed:
            return requested
        self.boundary += 1
        if self.pending is not None:
            self.pending.wait()
            stop, step_us, exact = (int(v) for v in self.buf.tolist())
            self.pending = None
            self.next_at = self.started_at + self.steps_between(step_us, bool(exact))
            if stop:
                return True
        if self.boundary >= self.next_at:
            self.start(requested)
        return False

    def start(self, requested: bool) -> None:
        import torch
        import torch.distributed as dist

        now = time.perf_counter()
        step_us = 0
        if self.t_started is not None:
            step_us = int(1e6 * (now - self.t_started) / max(1, self.boundary - self.started_at))
        self.t_started, self.started_at = now, self.boundary
        self.buf = torch.tensor([int(requested), step_us, int(self.exact)], dtype=torch.int64)
        self.pending = dist.all_reduce(self.buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def stop_here(vote: StopVote, request: StopRequest, step: int) -> bool:
    """This step boundary's stop vote (all ranks stop at the same step): True to stop now, and
    the request's watcher then knows that the loop acted (it writes the stop checkpoint, however
    long that takes)."""
    if not vote.poll(request.requested(step)):
        return False
    request.acted.set()
    return True


def say(message: str) -> None:
    """One `ddpkit: ...` line on stderr in one write (the stop watcher's, and the worker's
    refusals): every rank may say it at once into the same pipe, and `print` writes the text and
    its newline separately when Python is unbuffered (PYTHONUNBUFFERED, as the operators set
    it), so two ranks' lines could merge into one."""
    sys.stderr.write(f"ddpkit: {message}\n")
    sys.stderr.flush()
