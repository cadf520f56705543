"""The hang watchdog for your own script (`script:`/`module:` jobs), with no change to it.

The built-in trainer tells its watchdog where each rank is (trainer/watchdog.py: phases it
beats). A script says nothing, so its rank's watchdog thread reads where the main thread is
from its Python stack, once a second (`sys._current_frames`: no signal, no system call):

- `collective`: a frame in torch.distributed, DDP or autograd (the rank waits for the others,
  or computes the backward pass whose all-reduce they wait in);
- `script`: anywhere else once a step was seen (`setup` before): the rank's own work;

and the step hook (trainer/script_steps.py) marks each optimizer step. The deadlines:

- after `WARM_STEPS` steps: the trainer's rule, max(`train.hang_floor_s`, `train.hang_factor`
  x the p99 step time), on the time since the last step, wherever the rank is;
- before that, only while the rank waits in a collective: max(`hang_floor_s`,
  `train.timeout_s` / 2) since it began to wait (default 300 s: before torch's collective
  timeouts, 10 min for NCCL, 30 for gloo). A rank busy with its own work (loading data, a model,
  compiling) is never a hang by itself: the ranks that wait for it are the ones that notice.

The rest is the trainer's watchdog as it is (the store, the flag, every rank's stacks in
`RUN_DIR/debug/attempt-N/rank-R.txt`, one verdict naming the stuck rank, its node and its own
line, exit 124 and a group restart counted against `restarts`). It starts once the script's
process group exists (`init_process_group`; none: no watchdog) and connects to the job's store
as the trainer's does. `train.watchdog: false` turns it off.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from trainer.watchdog import STEP_PHASES, WARM_STEPS, Heartbeat, Watchdog

#: A frame in these is a rank waiting for the others (a collective, DDP's all-reduce in backward).
COLLECTIVE_FILES = re.compile(r"torch/distributed/|torch/nn/parallel/distributed\.py|torch/autograd/")
#: How often the thread looks for the process group before the script made one.
GROUP_POLL_S = 1.0
#: Step windows each rank publishes: rank 0 compares those every rank has, once a second.
PUBLISH_WINDOWS = 8
#: Step windows a rank keeps: rank 0 compares its own with the others', which are a tick older.
KEEP_WINDOWS = 64

Frame = tuple[str, int, str]  # file, line, function


def _own(file: str) -> bool:
    """A frame of the script's own code: outside torch, the standard library, the installed
    packages (frameworks: transformers, Lightning, Accelerate) and ddpkit's guard."""
    return ("/torch/" not in file and "/lib/python3" not in file and not file.startswith("<")
            and not file.endswith(("trainer/guard.py", "trainer/script_steps.py")))


def where_is(frames: list[Frame]) -> tuple[bool, str]:
    """(waiting in a collective, `train.py:88 in main (waiting in all_reduce)`): the innermost
    own frame, frames innermost first. The innermost frame that is either the script's own or
    a collective's decides: Lightning runs `training_step` inside DDP's forward (and Hugging
    Face's Trainer the model's forward), so a rank stuck in its own step has a DDP frame further
    out, and waits for nothing."""
    own = next(((f, n, fn) for f, n, fn in frames if _own(f)), frames[0] if frames else None)
    said = f"{os.path.basename(own[0])}:{own[1]} in {own[2]}" if own else "?"
    decides = next((f for f, _, _ in frames if COLLECTIVE_FILES.search(f) or _own(f)), "")
    if COLLECTIVE_FILES.search(decides):
        op = next((fn for f, _, fn in frames if COLLECTIVE_FILES.search(f)), "?")
        return True, f"{said} (waiting in {op})"
    return False, f"{said} (outside any collective)"


class ScriptHeartbeat(Heartbeat):
    """Where a script's rank is: steps from the hook, the phase from the main thread's stack."""

    def __init__(self) -> None:
        super().__init__()
        self.main_ident = threading.main_thread().ident
        self.stepped_at = self.since  # the last step's end (the start before any)
        self.waiting_since: float | None = None
        self.where: str | None = None
        self.windows: tuple[dict[str, Any], ...] = ()  # the last step windows (trainer/script_steps.py)

    def stepped(self, step: int) -> None:
        """The step hook: optimizer step `step` ended (main thread)."""
        self.step_done()
        self.step, self.stepped_at = step, time.time()
        self.since = self.stepped_at

    def window_done(self, step: int, medians: dict[str, float]) -> None:
        """The step hook: the medians of the window that ended at `step`, published with the
        heartbeat (the last `PUBLISH_WINDOWS`, for a rank 0 that reads them a second later)."""
        self.windows = (*self.windows[-(KEEP_WINDOWS - 1):], {"at_step": step, **medians})

    def observe(self) -> None:
        """The watchdog thread, each tick: the phase and the line from the main thread's stack."""
        frame = sys._current_frames().get(self.main_ident)
        if frame is None:
            return
        frames = [(f.filename, f.lineno or 0, f.name)  # innermost first, as walk_stack gives them
                  for f in traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)]
        waiting, self.where = where_is(frames)
        now = time.time()
        self.waiting_since = (self.waiting_since or now) if waiting else None
        self.phase = "collective" if waiting else ("script" if self.step else "setup")
        warm = len(self.step_times) >= WARM_STEPS
        self.since = max(self.stepped_at, self.waiting_since) if waiting and not warm else self.stepped_at

    def deadline(self, floor_s: float, factor: float, timeout_s: float) -> float:
        if len(self.step_times) >= WARM_STEPS and self.phase in STEP_PHASES:
            return super().deadline(floor_s, factor, timeout_s)
        return max(floor_s, timeout_s / 2) if self.waiting_since is not None else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "where": self.where, "windows": list(self.windows[-PUBLISH_WINDOWS:])}


def group_module() -> Any:
    """torch.distributed once it is imported and available, else None. The script's main thread
    may be importing it right now (Lightning's imports took long enough for a tick to land in
    them): `sys.modules` then holds a partly initialized module without `is_initialized` yet."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or getattr(getattr(dist, "__spec__", None), "_initializing", False):
        return None
    try:
        return dist if dist.is_available() and callable(dist.is_initialized) else None
    except AttributeError:  # an import in progress that the spec did not say
        return None


class ScriptWatchdog(Watchdog):
    """The trainer's watchdog on a script's rank: it waits for the process group, reads the
    stack each tick, and writes its stacks into the guard's file (trainer/guard.py)."""

    def __init__(self, heartbeat: ScriptHeartbeat, stacks: IO[str], *, on_windows: Any = None, **kw: Any) -> None:
        super().__init__(heartbeat, rank=0, world=1, **kw)  # rank, world: from the group, once made
        self.hb: ScriptHeartbeat = heartbeat
        self.stacks = stacks
        self.on_windows = on_windows  # rank 0: every rank's window of steps (stragglers)
        self.compared = 0  # the step of the last window compared

    def _run(self) -> None:
        dist = None
        while not self.done.wait(GROUP_POLL_S):
            dist = group_module()
            if dist is not None and dist.is_initialized():
                break
        else:
            return
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        super()._run()

    def _tick(self, store: Any) -> None:
        self.hb.observe()
        super()._tick(store)
        if self.rank == 0 and self.world > 1 and self.on_windows is not None:
            self._compare_windows(store)

    def _compare_windows(self, store: Any) -> None:
        """Rank 0: each window every rank has published, oldest first, to `on_windows`."""
        new = sorted(w["at_step"] for w in self.hb.windows if w["at_step"] > self.compared)
        keys = [self._key(r) for r in range(self.world)]
        if not new or not store.check(keys):
            return
        beats = [json.loads(beat) for beat in store.multi_get(keys)]
        windows = [{w["at_step"]: w for w in beat.get("windows", ())} for beat in beats]
        windows[0] = {w["at_step"]: w for w in self.hb.windows}  # all it kept (the others': a tick older)
        for step in new:
            if all(step in w for w in windows):
                self.on_windows([{"rank": r, "host": beats[r].get("host"), **windows[r][step]}
                                 for r in range(self.world)])
                self.compared = step

    def _write_stacks(self) -> Path:
        """Into the guard's open file (its stop-signal dump is no longer needed: these are newer)."""
        for stop in (signal.SIGTERM, signal.SIGINT):
            faulthandler.unregister(stop)
        hb = self.hb
        self.stacks.seek(0)
        self.stacks.truncate()
        self.stacks.write(f"rank {self.rank} on {socket.gethostname()} (pid {os.getpid()}), attempt {self.attempt}, "
                          f"in {hb.phase} at step {hb.step} for {time.time() - hb.since:.1f}s at {hb.where}; main "
                          f"thread 0x{hb.main_ident or 0:016x}\n\n")
        self.stacks.flush()
        faulthandler.dump_traceback(self.stacks, all_threads=True)
        self.stacks.flush()
        return Path(self.stacks.name)


def start(stacks: IO[str], *, attempt: int, debug_dir: Path, floor_s: float, factor: float,
          timeout_s: float, on_hang: Any = None, on_windows: Any = None) -> ScriptHeartbeat:
    """Start this rank's watchdog thread; the step hook calls the returned heartbeat's `stepped`."""
    heartbeat = ScriptHeartbeat()
    ScriptWatchdog(heartbeat, stacks, attempt=attempt, debug_dir=debug_dir, floor_s=floor_s, factor=factor,
                   timeout_s=timeout_s, on_hang=on_hang, on_windows=on_windows).start()
    return heartbeat
