"""Progress of your own script with no change to it: its optimizer steps, counted by a hook.

`trainer.guard` runs every worker of a `script:`/`module:` job. Before the script starts it
registers one global optimizer-step hook (`torch.optim.optimizer.register_optimizer_step_post_hook`:
every optimizer of the process, whatever made it: a plain loop, Hugging Face's `Trainer`,
Lightning, Accelerate), so each rank knows its steps and their times without the script saying
anything. Rank 0 keeps the same progress record as the built-in trainer
(trainer/progress.py: `RUN_DIR/attempts/attempt-N.json`, the ledger, the `ddpkit-progress`
line), which is what `ddpkit status`, `--watch`, `--json`, `why` and the goodput read.

What counts as a step: a `step()` of the first optimizer that steps in the process (a GAN's
second optimizer, or a second optimizer of the same step, is not counted twice); an optimizer
whose step was skipped by a GradScaler (inf/NaN gradients) does not step, so it is not counted.
The total for the ETA is the job file's `steps:`; without it, `status` shows the step and the
rate, no ETA.

Stragglers, from the same hook: from the first step on, every parameter of the counted optimizer
has a post-accumulate-grad hook that notes the time (`Tensor.register_post_accumulate_grad_hook`).
A step's own part (`own_s`: data, forward and backward up to its last gradient) is from the
previous step's end to that time; the rest (`wait_s`: DDP's wait for the other ranks'
gradients, then the optimizer) is what a fast rank spends waiting for the slow one. Every
`train.log_every_steps` steps each rank takes the medians of its window (trainer/stragglers.py
`StepTimes`) and its watchdog publishes them with its heartbeat in the job's store (no
collective of the script's own process group is touched); rank 0's watchdog compares the
windows every rank has and names a rank over `train.straggler_factor` x the others' median own
time in 5 compared windows in a row (`StragglerFinder`, as for the built-in trainer): a
`ddpkit straggler:` line on rank 0's stderr, `straggler` and `ranks` in the progress record. The
times are the host's: on a GPU they are when the kernels were queued, which a rank reaches late
when it is slow to feed its GPU or when it waits for it (a synchronizing call in its step).
Without the watchdog (`train.watchdog: false`, or no process group) there is no comparison.

Cost per step: one hook call that compares an id, appends a time and, on rank 0, takes an
uncontended lock for a 12-byte `pwrite` (the record itself at most once a second; a thread
rewrites it once a second too, so it says the last step when the steps stop coming), and one
`time.time()` per parameter tensor in backward: bench/script_steps.py measures it against the
same script without the hooks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer.contract import PROGRESS_LINES_VAR
from trainer.progress import WRITE_EVERY_S, Ledger, Progress
from trainer.stragglers import StepTimes, StragglerFinder, describe, per_rank_rates

#: The phase the ledger books while the script trains (it has no finer phases the hook sees).
TRAINING = "productive"


class ScriptSteps:
    """One rank's count of its script's optimizer steps; rank 0 writes the progress record."""

    def __init__(self, run_dir: Path | None, is_main: bool, *, total_steps: int | None,
                 restarts_allowed: int, t0: float, window_steps: int = 10,
                 straggler_factor: float = 1.5) -> None:
        self.step = 0
        self.optimizer: int | None = None  # id() of the optimizer whose steps are counted
        self.last: float | None = None  # when the last counted step ended
        self.ledger = Ledger(t0)  # `startup` from the launch until the guard is here
        self.ledger.enter("setup")  # the script's own imports, process group, model, data
        self.progress = None
        self.steps_given = total_steps is not None  # the job file's `steps:` (wins over a framework's)
        self.heartbeat: Any = None  # trainer/script_watch.py's, when the watchdog runs
        self.lock = threading.Lock()  # rank 0's record: the hook and `_keep_fresh` write it
        self.ended = False
        self.grad_at: float | None = None  # this step's last gradient (module docstring)
        self.times = StepTimes()  # this rank's steps since its last window
        self.window_steps = window_steps
        self.stragglers = StragglerFinder(straggler_factor)  # rank 0's verdicts
        if is_main and run_dir is not None:
            self.progress = Progress(run_dir, self.ledger, total_steps=total_steps or 0, epochs=0,
                                     global_batch=0, restarts_allowed=restarts_allowed)
            # `run --local` shows a script's output as it is and reads the record from the file
            self.progress.lines = os.environ.get(PROGRESS_LINES_VAR) != "0"
            self.progress.tick(0, 0, force=True)  # `status` says running from the worker's start

    def install(self) -> Any:
        """Register the global hook (imports torch.optim: the script is about to import torch)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self.progress is not None:
            threading.Thread(target=self._keep_fresh, name="ddpkit-progress", daemon=True).start()
        return register_optimizer_step_post_hook(self.hook)

    def _keep_fresh(self) -> None:
        """Rank 0, once a second: the record says the last step even when steps stop coming
        (the hook writes at most once a second, so a burst of fast steps and then a rank blocked
        in a collective would leave it a second behind for good)."""
        while True:
            time.sleep(WRITE_EVERY_S)
            with self.lock:
                if self.ended:
                    return
                self.progress.tick(self.step, 0)

    def hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.optimizer is None:
            self.optimizer = id(optimizer)
        elif id(optimizer) != self.optimizer:
            return
        now = time.time()
        self.step += 1
        self._time_step(optimizer, now)
        self.last = now
        if self.heartbeat is not None:
            self.heartbeat.stepped(self.step)
        if self.progress is None:
            return
        if self.step == 1:
            self.ledger.enter(self.progress.phase_of(0), at=self.last)
        elif self.ledger.phase == "redone" and self.step > self.progress.furthest:
            self.ledger.enter("productive", at=self.last)
        with self.lock:
            self.progress.tick(self.step, 0)

    def _time_step(self, optimizer: Any, now: float) -> None:
        """This step's own part into the window; the window's medians to the heartbeat every
        `window_steps` steps (module docstring)."""
        if self.step == 1:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.requires_grad:
                        with contextlib.suppress(RuntimeError):  # a parameter that takes no hooks
                            param.register_post_accumulate_grad_hook(self._gradient_ready)
        elif self.grad_at is not None and self.last is not None and self.grad_at > self.last:
            self.times.add_own(now - self.last, self.grad_at - self.last)
        if self.step % self.window_steps == 0 and self.heartbeat is not None:
            window = self.times.take()
            if window is not None:
                self.heartbeat.window_done(self.step, window)

    def _gradient_ready(self, param: Any) -> None:
        self.grad_at = time.time()

    def compare(self, ranks: list[dict[str, Any]]) -> None:
        """Rank 0's watchdog thread: every rank's window ending at the same step."""
        straggler, new = self.stragglers.window(ranks)
        if new:
            print(f"ddpkit straggler: {describe(straggler)} (its own work {1000 * straggler['own_s']:.1f} ms "
                  f"a step against {1000 * straggler['others_own_s']:.1f} ms on the other ranks, "
                  f"{straggler['windows']} windows of {self.window_steps} steps in a row)", file=sys.stderr, flush=True)
        if self.progress is not None:
            with self.lock:
                self.progress.straggler, self.progress.ranks = straggler, per_rank_rates(ranks)

    def finish(self, state: str) -> None:
        """The script ended on its own (`completed`): the attempt's last record."""
        if self.progress is not None:
            with self.lock:
                self.ended = True
                self.ledger.enter("finish")
                self.progress.straggler = self.stragglers.last_named  # the run's, as the trainer's summary
                self.progress.publish(self.step, 0, state)

    def hung(self, found: dict[str, Any]) -> None:
        """Rank 0, the watchdog found a hang: in the ledger, and the attempt's last record."""
        if self.progress is not None:
            with self.lock:
                self.ended = True
                self.ledger.rebook(found.get("age_s", 0.0), "hang")
                self.progress.straggler = self.stragglers.last_named
                self.progress.publish(self.step, 0, "hung")


def from_environment(run_dir: Path | None, rank: int, job: Any) -> ScriptSteps:
    """The counter for this worker, with the job file's (`JobSections`) planned steps and restarts."""
    from trainer.contract import LAUNCH_T0_VAR

    t0 = float(os.environ.get(LAUNCH_T0_VAR) or time.time())
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    return ScriptSteps(run_dir, rank == 0, total_steps=job.steps, restarts_allowed=job.restarts,
                       t0=time.time() if restarted else t0, window_steps=job.train.log_every_steps,
                       straggler_factor=job.train.straggler_factor)
