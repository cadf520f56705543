"""Checkpoint save time on the `gpt` workload's state: synchronous vs `checkpoint.async_save`.

The state is the trainer's own (`Trainer.checkpoint_state`: model, AdamW moments, scheduler,
RNG states, config) after one optimizer step of the `gpt` workload with its default size, built
by the trainer's `setup()` in this process. Interleaved `--repeats` times into a fresh directory:

- synchronous: `checkpoint.save` (serialize, sha256, temporary files, fsync, rename), all of it
  blocking the training loop;
- asynchronous: `AsyncSaver.submit` (the blocking part: copy every tensor into reused host
  buffers and start the writer thread), then the background write until it is published.

Also: the training step time (the trainer's step on this machine, `--batch` per step), how much
slower steps are while a background write is in flight (the writer shares the cores and the
GIL), and the checkpoint's share of training time at the default interval (every 200 steps).
Goal: blocking time of the asynchronous save <= 25% of the synchronous save.

    python bench/checkpoint_save.py [--repeats 5] [--batch 8] [--small]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import Result, Stats, fmt, ratio  # noqa: E402


def build_trainer(tmp: Path, batch: int, small: bool):
    import torch

    from trainer.config import JobSections
    from trainer.dist import DistEnv
    from trainer.stop import StopRequest
    from trainer.train import Trainer

    model_args = {"d_model": 64, "layers": 2, "heads": 2, "samples": 512} if small else {}
    job = JobSections.model_validate({
        "name": "ckpt-bench",
        "train": {"model": "gpt", "optimizer": "adamw", "batch_size": batch, "model_args": model_args,
                  "eval_every_epochs": 0, "plot": False, "output_dir": str(tmp / "runs"), "device": "cpu"},
        "checkpoint": {"dir": str(tmp / "unused")},
    })
    t = Trainer(job, DistEnv(), torch.device("cpu"), StopRequest(), time.time())
    t.setup()
    return t


def train_steps(t, n: int) -> list[float]:
    """`n` optimizer steps the trainer's way (forward, loss, backward, AdamW, scheduler)."""
    times = []
    t.batches.start(0)
    it = iter(t.loader)
    for _ in range(n):
        x, y = next(it)
        t0 = time.perf_counter()
        loss = t.workload.loss_fn(t.forward(t.to_device(x)), y)
        loss.backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="samples per step for the step-time figures")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: like one rank per core)")
    p.add_argument("--small", action="store_true", help="a tiny gpt (smoke test)")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = p.parse_args()
    import torch

    from trainer import checkpoint

    torch.set_num_threads(args.threads)
    r = Result("checkpoint_save", "Checkpoint save: synchronous vs asynchronous (gpt state)")
    tmp = Path(tempfile.mkdtemp(prefix="ddpkit-ckpt-bench-", dir=args.dir))
    try:
        t = build_trainer(tmp, args.batch, args.small)
        train_steps(t, 1)  # AdamW's moments exist from here on
        state = t.checkpoint_state([t.rng_state()])
        tensors = sum(v.numel() * v.element_size() for v in _tensors(state))
        ck = tmp / "ck"
        saver = checkpoint.AsyncSaver()
        sync_s, block_s, total_s, sizes = [], [], [], []
        a0 = time.perf_counter()
        saver.submit(ck, 999, state, keep=2)  # the first one also allocates the host buffers
        first_block = time.perf_counter() - a0
        saver.wait()
        for i in range(args.repeats):
            s0 = time.perf_counter()
            path = checkpoint.save(ck, 2 * i, state, keep=2)
            sync_s.append(time.perf_counter() - s0)
            sizes.append(path.stat().st_size)
            a0 = time.perf_counter()
            saver.submit(ck, 2 * i + 1, state, keep=2)
            block_s.append(time.perf_counter() - a0)
            saver.wait()
            total_s.append(time.perf_counter() - a0)
            print(f"  repeat {i + 1}/{args.repeats}: sync {sync_s[-1]:.3f} s, async blocking {block_s[-1]:.3f} s, "
                  f"async until published {total_s[-1]:.3f} s", flush=True)
        # Step time alone, and while a background write is in flight.
        steps_alone, steps_during = [], []
        for _ in range(max(1, args.repeats // 2)):
            steps_alone += train_steps(t, 4)
            saver.submit(ck, 1000, t.checkpoint_state([t.rng_state()]), keep=2)
            while saver.pending():
                steps_during += train_steps(t, 1)
            saver.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    sync, block, total = Stats(sync_s), Stats(block_s), Stats(total_s)
    alone, during = Stats(steps_alone), Stats(steps_during)
    share = ratio(block["median"], block["median"] + 200 * alone["median"])
    share_sync = ratio(sync["median"], sync["median"] + 200 * alone["median"])
    goal = ratio(block["median"], sync["median"])
    r.text(f"The `gpt` workload's checkpoint state{' (tiny model: --small)' if args.small else ''}: "
           f"{tensors / 2**20:.1f} MiB of tensors (model + AdamW moments + RNG), file "
           f"{Stats(sizes)['median'] / 2**20:.1f} MiB, written to a temporary directory on the local disk, "
           f"{args.repeats} interleaved repeats. Step time: the trainer's step (batch {args.batch}, "
           f"{torch.get_num_threads()} threads, CPU).")
    r.table("seconds, median (min-max, n); ratio = / synchronous save",
            ["figure", "seconds", "ratio"], [
                ["synchronous save (blocks training)", sync.fmt(".3f"), "1.00"],
                ["asynchronous save: blocking (copy to host + start the writer)", block.fmt(".3f"), fmt(goal, ".3f")],
                ["asynchronous save: blocking, the run's first (allocates the host buffers)", f"{first_block:.3f} (n=1)",
                 fmt(ratio(first_block, sync["median"]), ".3f")],
                ["asynchronous save: until published", total.fmt(".3f"), fmt(ratio(total["median"], sync["median"]), ".2f")],
                ["training step, no save in flight", alone.fmt(".3f"), "-"],
                ["training step while a background write is in flight", during.fmt(".3f"),
                 f"{fmt(ratio(during['median'], alone['median']), '.2f')}x the step alone"],
            ])
    r.table("checkpoint share of training time at the default interval (every 200 steps)",
            ["mode", "share"], [["synchronous", fmt(share_sync, ".2%")], ["asynchronous (blocking part)", fmt(share, ".2%")]])
    r.note(f"goal: async blocking <= 25% of the synchronous save: {fmt(goal, '.1%')} -> "
           f"{'met' if goal is not None and goal <= 0.25 else 'NOT met'}")
    r.chart("checkpoint_save.png", "checkpoint save, gpt state (median, min-max)", "seconds",
            ["sync save", "async: blocking", "async: published"],
            {"seconds": [sync["median"], block["median"], total["median"]]},
            low={"seconds": [sync["min"], block["min"], total["min"]]},
            high={"seconds": [sync["max"], block["max"], total["max"]]})
    r.doc["data"] = {"sync_s": sync, "async_blocking_s": block, "async_total_s": total, "tensor_bytes": tensors,
                     "step_s": alone, "step_during_write_s": during}
    r.save()
    return 0


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    raise SystemExit(main())
