"""Every rank's step times, and the straggler: a rank that is persistently slower than the rest.

Every rank's `Heartbeat` (trainer/watchdog.py) already says which phase of a step its main
thread is in; it also adds up the seconds spent in each phase of each step (`Heartbeat.phase_s`).
From those, every rank keeps one record per optimizer step (`StepTimes.add`):

| field | what the rank did | waits for the others? |
|---|---|---|
| `step_s` | the whole step, from the previous step's end | |
| `data_s` | waited for its batch (the DataLoader, or the in-memory data set) | no |
| `forward_s` | forward passes | no (DDP's buffer broadcast, if the model has buffers, is tiny) |
| `backward_s` | backward passes up to the last gradient bucket: DDP's all-reduce of the earlier buckets runs beside them | no |
| `allreduce_s` | from the last bucket handed to the all-reduce to the end of backward | yes |
| `optimizer_s` | clipping, the optimizer and the LR schedule | no |
| `vote_s` | the previous step boundary's collectives: the stop vote, this comparison | yes |

(`step_s` also holds what no field does: rank 0's logging and progress records, checkpoint
saves.)

With DDP a fast rank catches the slow one inside a collective: its all-reduce cannot end before
the slow rank's last bucket arrives, so every rank's `step_s` comes out the same. What tells
ranks apart is the work before that: `own_s` = `data_s + forward_s + backward_s + optimizer_s`;
`wait_s` = `allreduce_s + vote_s`. The moment the last bucket is ready comes from a DDP comm
hook (`BucketClock.wrap`) around the all-reduce DDP would run anyway (`train.ddp_comm_hook`:
torch's `allreduce_hook`, the same division by the world size and the same sum as DDP's
built-in one, or the fp16/bf16 compression hook).

Every `train.log_every_steps` steps, every rank sends the medians of its window of steps to the
others (one small `all_gather_object` on the gloo control group), and rank 0 writes them as one
record to metrics.jsonl (`{"ranks_at_step": N, "ranks": [...]}`). A rank whose median `own_s`
is more than `train.straggler_factor` times the median of the other ranks' (and at least
`MIN_GAP_S` more) in `PERSIST_WINDOWS` windows in a row is named the straggler: a warning in
rank 0's log, `straggler` in the progress record (so `ddpkit status` shows it), in the
metrics record and in the run's summary. It stays named until a window clears it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

#: The phases of a step (trainer/watchdog.py's Heartbeat) and the fields they are written as.
PHASE_FIELDS = {"data": "data_s", "forward": "forward_s", "backward": "backward_s",
                "allreduce": "allreduce_s", "optimizer": "optimizer_s", "vote": "vote_s"}
OWN = ("data_s", "forward_s", "backward_s", "optimizer_s")  # this rank's own work
WAIT = ("allreduce_s", "vote_s")  # waiting for the others
PERSIST_WINDOWS = 5
MIN_GAP_S = 0.002  # a gap smaller than this is noise whatever the ratio


class BucketClock:
    """When DDP last handed a gradient bucket to the all-reduce, in this rank's backward."""

    def __init__(self) -> None:
        self.last_ready: float | None = None

    def wrap(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """`hook` (a DDP comm hook) that first notes the time."""
        def timed(state, bucket):  # no annotations: DDP checks them against its own types
            self.last_ready = time.time()
            return hook(state, bucket)
        return timed


class StepTimes:
    """One rank's per-step times since the last window."""

    def __init__(self) -> None:
        self.window: list[dict[str, float]] = []

    def add(self, step_s: float, phase_s: dict[str, float]) -> None:
        record = {"step_s": step_s, **{f: phase_s.get(p, 0.0) for p, f in PHASE_FIELDS.items()}}
        record["own_s"] = sum(record[f] for f in OWN)
        record["wait_s"] = sum(record[f] for f in WAIT)
        self.window.append(record)

    def add_own(self, step_s: float, own_s: float) -> None:
        """A step known only as a whole and its own part (a script's: trainer/script_steps.py)."""
        self.window.append({"step_s": step_s, "own_s": own_s, "wait_s": max(0.0, step_s - own_s)})

    def take(self) -> dict[str, float] | None:
        """The medians of the window's steps (None for an empty window); a new window."""
        steps, self.window = self.window, []
        if not steps:
            return None
        return {k: round(statistics.median(s[k] for s in steps), 6) for k in steps[0]} | {"steps": len(steps)}


def slowest(ranks: list[dict[str, Any]], factor: float) -> dict[str, Any] | None:
    """The rank of one window whose `own_s` is over `factor` x the median of the others' (and
    `MIN_GAP_S` more), the slowest if several; None when no rank is."""
    timed = [r for r in ranks if r.get("own_s") is not None]
    if len(timed) < 2:
        return None
    worst = max(timed, key=lambda r: r["own_s"])
    others = statistics.median(r["own_s"] for r in timed if r is not worst)
    if worst["own_s"] > factor * others and worst["own_s"] - others > MIN_GAP_S:
        return {"rank": worst["rank"], "host": worst.get("host"),
                "slower": round(worst["own_s"] / others, 2) if others > 0 else None,
                "own_s": worst["own_s"], "others_own_s": round(others, 6)}
    return None


class StragglerFinder:
    """Rank 0: the windows' verdicts, and the rank named once it is slowest `PERSIST_WINDOWS`
    windows in a row."""

    def __init__(self, factor: float, persist: int = PERSIST_WINDOWS) -> None:
        self.factor, self.persist = factor, persist
        self.run: tuple[int, int] | None = None  # (rank, windows in a row)
        self.named: dict[str, Any] | None = None  # now
        self.last_named: dict[str, Any] | None = None  # the last one named (for the summary)

    def window(self, ranks: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, bool]:
        """This window's slowest rank; (the straggler named now or still, newly named?)."""
        found = slowest(ranks, self.factor)
        if found is None:
            self.run, self.named = None, None
            return None, False
        count = self.run[1] + 1 if self.run and self.run[0] == found["rank"] else 1
        self.run = (found["rank"], count)
        if count < self.persist:
            if self.named and self.named["rank"] != found["rank"]:
                self.named = None
            return self.named, False
        new = self.named is None or self.named["rank"] != found["rank"]
        self.named = self.last_named = {**found, "windows": count}
        return self.named, new


def describe(straggler: dict[str, Any] | None) -> str:
    """`rank 1 on node-b 2.4x slower` (empty for none)."""
    if not straggler:
        return ""
    where = f" on {straggler['host']}" if straggler.get("host") else ""
    slower = f" {straggler['slower']}x slower" if straggler.get("slower") else " slower"
    return f"rank {straggler['rank']}{where}{slower}"


def per_rank_rates(ranks: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the progress record keeps of a window per rank: its steps/s and own time."""
    return [{"rank": r["rank"], "host": r.get("host"),
             "steps_per_s": round(1.0 / r["step_s"], 3) if r.get("step_s") else None,
             "own_s": r.get("own_s"), "wait_s": r.get("wait_s")} for r in ranks]
