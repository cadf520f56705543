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

Cost per step: one hook call that compares an id, appends a time and, on rank 0, takes an
uncontended lock for a 12-byte `pwrite` (the record itself at most once a second; a thread
rewrites it once a second too, so it says the last step when the steps stop coming):
bench/script_steps.py measures it against the same script without the hook.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from trainer.contract import PROGRESS_LINES_VAR
from trainer.progress import WRITE_EVERY_S, Ledger, Progress

#: The phase the ledger books while the script trains (it has no finer phases the hook sees).
TRAINING = "productive"


class ScriptSteps:
    """One rank's count of its script's optimizer steps; rank 0 writes the progress record."""

    def __init__(self, run_dir: Path | None, is_main: bool, *, total_steps: int | None,
                 restarts_allowed: int, t0: float) -> None:
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
        self.step += 1
        self.last = time.time()
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

    def finish(self, state: str) -> None:
        """The script ended on its own (`completed`): the attempt's last record."""
        if self.progress is not None:
            with self.lock:
                self.ended = True
                self.ledger.enter("finish")
                self.progress.publish(self.step, 0, state)

    def hung(self, found: dict[str, Any]) -> None:
        """Rank 0, the watchdog found a hang: in the ledger, and the attempt's last record."""
        if self.progress is not None:
            with self.lock:
                self.ended = True
                self.ledger.rebook(found.get("age_s", 0.0), "hang")
                self.progress.publish(self.step, 0, "hung")


def from_environment(run_dir: Path | None, rank: int, job: Any) -> ScriptSteps:
    """The counter for this worker, with the job file's (`JobSections`) planned steps and restarts."""
    from trainer.contract import LAUNCH_T0_VAR

    t0 = float(os.environ.get(LAUNCH_T0_VAR) or time.time())
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    return ScriptSteps(run_dir, rank == 0, total_steps=job.steps, restarts_allowed=job.restarts,
                       t0=time.time() if restarted else t0)
