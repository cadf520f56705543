"""What a training run records beside the math, behind one object (`Recorder`), so that the
trainer's step reads as the math and each piece of bookkeeping is one call.

- where this rank is, for the hang watchdog and the straggler finder: the `Heartbeat`'s phases
  (trainer/watchdog.py), and the wait for the other ranks' gradients (`BucketClock`);
- the attempt's ledger and rank 0's progress record (trainer/progress.py), ticked after each step;
- rank 0's `metrics.jsonl` (a line per logged step, checkpoint, evaluation, window of per-rank
  step times, and the summary) and the progress bar;
- this session's throughput window (from `STEADY_AFTER_STEPS` on, evaluation time left out),
  the launch marks and the first step's time;
- each rank's step times, compared every `train.log_every_steps` steps (a collective: every rank
  calls it), and rank 0's straggler verdicts (trainer/stragglers.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainer.progress import Exporter, Ledger, Progress
from trainer.stragglers import BucketClock, StepTimes, StragglerFinder, describe, per_rank_rates
from trainer.watchdog import Heartbeat

STEADY_AFTER_STEPS = 20  # samples_per_s excludes the first steps (allocation, DDP bucket rebuild)

log = logging.getLogger("ddpkit.trainer")


class Recorder:
    """One rank's records of a run (rank 0 writes the files); the trainer calls it, it never
    calls the trainer (a collective it takes part in gets the trainer's `all_gather`)."""

    def __init__(self, cfg: Any, run_dir: Path, rank: int, is_main: bool, t0: float, ledger: Ledger | None = None):
        self.cfg, self.run_dir, self.rank, self.is_main, self.t0 = cfg, run_dir, rank, is_main, t0
        self.ledger = ledger or Ledger(t0, phase="setup")  # rank 0's is the one written
        self.hb = Heartbeat()  # where this rank is, for the hang watchdog
        self.bucket_clock = BucketClock()  # when DDP's last gradient bucket was ready
        self.step_times = StepTimes()  # this rank's, per step (trainer/stragglers.py)
        self.stragglers = StragglerFinder(cfg.straggler_factor)  # rank 0's verdicts
        self.ranks_overall: list[dict[str, Any]] = []  # rank 0: every window's per-rank medians
        self.progress: Progress | None = None  # rank 0, once the step count is known (`start_progress`)
        self.marks: dict[str, float] = {}  # launch marks: name -> time.time()
        self.file = None
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        # this session's steps (`start_session`)
        self.global_batch = 0
        self.total_steps = 0
        self.pbar: Any = None
        self.pending: list[tuple[int, int, Any, float, float]] = []  # step, epoch, loss, lr, dt
        self.losses: list[float] = []  # every flushed step's loss
        self.steps = 0  # optimizer steps in this session
        self.t_prev = 0.0  # perf_counter at the previous step's end
        self.first_step_s: float | None = None
        self.window_t0: float | None = None  # the throughput window: its start, and steps since
        self.window_steps = 0
        self.paused = 0.0  # evaluation time inside the window
        self.t_end = 0.0  # the loop's end

    # -- files and records ----------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """One line of rank 0's metrics.jsonl (other ranks write nothing)."""
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def mark(self, name: str) -> None:
        """A launch mark: `name` happened now (the summary's `launch_marks`)."""
        self.marks[name] = time.time()

    def start_progress(self, total_steps: int, epochs: int, global_batch: int, restarts_allowed: int) -> None:
        """Rank 0's progress record, once the step count is known."""
        if not self.is_main:
            return
        self.progress = Progress(self.run_dir, self.ledger, total_steps=total_steps, epochs=epochs,
                                 global_batch=global_batch, restarts_allowed=restarts_allowed)
        self.progress.exporter = self.prometheus_exporter()

    def prometheus_exporter(self) -> Exporter | None:
        """`train.prometheus_port` / `train.prometheus_textfile` (rank 0), else None."""
        cfg = self.cfg
        if not (cfg.prometheus_port or cfg.prometheus_textfile):
            return None
        textfile = Path(cfg.prometheus_textfile) if cfg.prometheus_textfile else None
        if textfile is not None and not textfile.is_absolute():
            textfile = self.run_dir / textfile
        log.info("Prometheus: %s", ", ".join(filter(None, [
            cfg.prometheus_port and f"http://{socket.gethostname()}:{cfg.prometheus_port}/metrics",
            textfile and str(textfile)])))
        return Exporter(self.run_dir.name, port=cfg.prometheus_port, textfile=textfile)

    @property
    def attempt(self) -> int:
        """This attempt's number (rank 0's; 0 elsewhere)."""
        return self.progress.attempt if self.progress else 0

    def resumed(self, **fields: Any) -> None:
        """What the resume found (the checkpoint, the step, those skipped), for `ddpkit why`."""
        if self.progress is not None:
            self.progress.resumed = {**(self.progress.resumed or {}), **fields}

    def resized(self, total_steps: int, global_batch: int) -> None:
        """A resume at another world size changed the step count or the global batch."""
        if self.progress is not None:
            self.progress.total_steps, self.progress.global_batch = total_steps, global_batch

    def hung(self, found: dict[str, Any], step: int, epoch: int) -> None:
        """Rank 0: the watchdog found a hang; in the ledger, and the attempt's last record."""
        if self.progress is not None:
            self.ledger.rebook(found.get("age_s", 0.0), "hang")
            self.progress.publish(step, epoch, "hung")

    def failed(self, step: int, epoch: int, hang_booked: bool) -> None:
        """The attempt ends with an exception: its last record (never hiding the exception)."""
        if self.progress is not None and not hang_booked:
            with contextlib.suppress(Exception):
                self.progress.publish(step, epoch, "failed")

    # -- where this rank is ---------------------------------------------------------------------
    def beat(self, phase: str) -> None:
        """This rank is now in `phase` (the heartbeat)."""
        self.hb.beat(phase)

    @contextlib.contextmanager
    def during(self, phase: str, booked: str | None = None) -> Iterator[None]:
        """The heartbeat in `phase` (then back in the phase it was in), and the ledger's class
        `booked` for the time, when given."""
        left = self.hb.phase
        self.hb.beat(phase)
        try:
            with self.ledger.during(booked) if booked else contextlib.nullcontext():
                yield
        finally:
            self.hb.beat(left)

    def forward(self, step: int) -> None:
        """The forward of step `step + 1` starts."""
        self.hb.beat("forward", step)

    @contextlib.contextmanager
    def backward(self, timed: bool = True) -> Iterator[None]:
        """A backward (DDP's all-reduce runs in it); `timed`: its tail after this rank's last
        bucket was ready is booked as waiting for the other ranks' gradients."""
        self.hb.beat("backward")
        self.bucket_clock.last_ready = None
        yield
        if timed and self.bucket_clock.last_ready is not None:  # waited for the others' gradients since
            self.hb.rebook("allreduce", time.time() - self.bucket_clock.last_ready)
        self.bucket_clock.last_ready = None

    # -- the steps of this session ----------------------------------------------------------------
    def start_session(self, total_steps: int, step: int, global_batch: int) -> None:
        """Before the first step of this session: the progress bar, the step clock, a record."""
        self.total_steps, self.global_batch = total_steps, global_batch
        self.pbar = _progress_bar(total_steps, step, enabled=self.is_main)
        self.paused = 0.0
        self.t_prev = time.perf_counter()

    def step_done(self, step: int, epoch: int, loss: Any, lr: float, sync: Callable[[], None]) -> None:
        """An optimizer step ended: its loss and time for the next flush, the first-step launch
        mark, the throughput window (it starts after `STEADY_AFTER_STEPS` steps of this
        session), the ledger and progress record. `sync` waits for the device."""
        self.steps += 1
        self.hb.step_done()
        self.hb.beat("log")  # the bookkeeping below is no rank's step work (trainer/stragglers.py)
        t_now = time.perf_counter()
        self.pending.append((step, epoch, loss, lr, t_now - self.t_prev))
        if self.hb.last_step is not None:
            self.step_times.add(*self.hb.last_step)
        self.t_prev = t_now
        self.tick(step, epoch)
        if self.first_step_s is None:
            sync()
            self.first_step_s = time.time() - self.t0
            self.marks["first step"] = self.t0 + self.first_step_s
            if self.is_main:
                log.info("first step %.2fs after launch (%s)", self.first_step_s, ", ".join(
                    f"{k} {v - self.t0:.2f}s" for k, v in self.marks.items()))
        if self.steps == STEADY_AFTER_STEPS or (self.window_t0 is None and self.steps == 1):
            sync()
            self.window_t0, self.window_steps, self.paused = time.perf_counter(), 0, 0.0
        else:
            self.window_steps += 1

    def tick(self, step: int, epoch: int, force: bool = False) -> None:
        """After a step: the class the next step is booked to (`redone` until the furthest step
        of an earlier attempt), and rank 0's progress record when one is due."""
        if self.progress is None:
            return
        if self.losses:
            self.progress.loss = self.losses[-1]
        phase = self.progress.phase_of(step)
        if phase != self.ledger.phase and self.ledger.phase in ("productive", "redone", "setup", "checkpoint_load"):
            self.ledger.enter(phase)
        self.progress.tick(step, epoch, force=force)

    def log_step(self, step: int) -> None:
        """The progress bar; every `train.log_every_steps`, the pending steps' metrics."""
        self.pbar.update(1)
        if step % self.cfg.log_every_steps == 0:
            self.flush()

    def flush(self) -> None:
        """Write the pending steps to metrics.jsonl and log the last one (one device sync for
        all their losses); FloatingPointError on a loss that is not finite, unless
        `train.stop_on_nonfinite_loss` is false."""
        if not self.pending:
            return
        import torch

        values = torch.stack([p[2] for p in self.pending]).float().tolist()
        for (step, epoch, _, lr, dt), loss in zip(self.pending, values, strict=True):
            self.losses.append(loss)
            self.write({"step": step, "epoch": epoch, "loss": loss, "lr": lr,
                        "samples_per_s": self.global_batch / dt if dt > 0 else None})
        bad = next(((p[0], v) for p, v in zip(self.pending, values, strict=True) if not math.isfinite(v)), None)
        if bad is not None and self.cfg.stop_on_nonfinite_loss:
            good = [(p[0], v) for p, v in zip(self.pending, values, strict=True) if math.isfinite(v)]
            last = f"; the last finite loss {good[-1][1]:.4g} at step {good[-1][0]}" if good else ""
            raise FloatingPointError(
                f"loss is {bad[1]} at step {bad[0]} on rank {self.rank}{last} (a learning rate too "
                "high, bad input, an overflow; train.stop_on_nonfinite_loss: false trains on)")
        step, epoch, _, lr, dt = self.pending[-1]
        msg = (f"step {step}/{self.total_steps} epoch {epoch} loss {values[-1]:.4f} lr {lr:.3g} "
               f"{self.global_batch / dt if dt > 0 else 0:.0f} samples/s")
        self.pbar.set_postfix_str(f"loss {values[-1]:.4f}", refresh=False)
        self.say(msg)
        self.pending.clear()

    def say(self, msg: str) -> None:
        """A line of the run's log (through the progress bar when there is one)."""
        if getattr(self.pbar, "disable", True):
            log.info(msg)
        else:
            self.pbar.write(msg)

    @contextlib.contextmanager
    def paused_for(self, phase: str, booked: str) -> Iterator[None]:
        """Work between steps that is not training (an evaluation): left out of the throughput
        window, and of the next step's time."""
        t = time.perf_counter()
        with self.during(phase, booked):
            yield
        self.paused += time.perf_counter() - t
        self.t_prev = time.perf_counter()

    def evaluated(self, step: int, epoch: int, result: dict[str, float] | None, say: bool = False) -> None:
        """An evaluation's result in metrics.jsonl (and the log, after an epoch)."""
        if result:
            self.write({"eval": True, "step": step, "epoch": epoch, **result})
            if say:
                self.say(f"eval after epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))

    def compare_ranks(self, step: int, all_gather: Callable[[Any], list[Any]] | None) -> None:
        """Every `log_every_steps` steps (every rank, a collective): each rank's medians of its
        window of steps to rank 0, which writes them and names a straggler (trainer/stragglers.py).
        `all_gather`: None with one rank."""
        if step % self.cfg.log_every_steps or all_gather is None:
            return
        self.hb.beat("vote")  # a collective at the step boundary, as the stop vote is
        mine = self.step_times.take()
        ranks = all_gather(mine and {"rank": self.rank, "host": socket.gethostname(), **mine})
        if not self.is_main or any(r is None for r in ranks):
            return
        straggler, new = self.stragglers.window(ranks)
        self.ranks_overall.append({r["rank"]: r["own_s"] for r in ranks})
        self.write({"ranks_at_step": step, "ranks": ranks, "straggler": straggler})
        if new:
            log.warning("straggler: %s (its own work %.1f ms a step against %.1f ms on the "
                        "other ranks, %d windows of %d steps in a row)", describe(straggler),
                        1000 * straggler["own_s"], 1000 * straggler["others_own_s"],
                        straggler["windows"], self.cfg.log_every_steps)
        if self.progress is not None:
            self.progress.straggler, self.progress.ranks = straggler, per_rank_rates(ranks)

    def end_session(self, sync: Callable[[], None]) -> None:
        """The loop ended: close the throughput window, flush the metrics, close the bar."""
        sync()
        self.t_end = time.perf_counter()
        self.flush()
        self.pbar.close()

    # -- the end of a run -----------------------------------------------------------------------
    def samples_per_s(self) -> float | None:
        """This session's throughput over its window (evaluation time left out)."""
        window = self.window_steps if self.window_t0 is not None else 0
        elapsed = (self.t_end - self.window_t0 - self.paused) if self.window_t0 is not None else 0.0
        return (window * self.global_batch / elapsed) if window and elapsed > 0 else None

    def launch_marks(self) -> dict[str, float]:
        """Seconds since the launch of each launch mark."""
        return {k: round(v - self.t0, 4) for k, v in self.marks.items()}

    def own_s_per_rank(self) -> dict[str, float] | None:
        """Rank 0: each rank's median own time a step (trainer/stragglers.py) over the session's
        windows; None with one rank or before the first window."""
        if not self.ranks_overall:
            return None
        return {str(r): round(statistics.median(w[r] for w in self.ranks_overall if r in w), 6)
                for r in sorted(self.ranks_overall[-1])}

    def publish(self, summary: dict[str, Any], step: int, epoch: int, status: str) -> None:
        """Rank 0: the attempt's last progress record, the summary in metrics.jsonl and on stdout."""
        if not self.is_main:
            return
        if self.progress is not None:
            # the run's last record names the run's straggler (as the summary does), even if
            # the last window cleared it: `ddpkit status` of an ended run says who was slow
            self.progress.straggler = summary.get("straggler")
            record = self.progress.publish(step, epoch, status)
            summary["attempt"], summary["goodput"] = record["attempt"], record["run"]["goodput"]
        self.write(summary)
        self.file.close()
        print("ddpkit-summary " + json.dumps(summary), flush=True)


def _progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on rank 0 when stderr is a terminal; a no-op object otherwise."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=None if enabled else True, unit="step", dynamic_ncols=True)
