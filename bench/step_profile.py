"""Where a training step's time goes at 1 and 2 ranks, and what DDP offers to hide communication.

The step is the trainer's (`trainer/train.py`): the `cnn` workload and its data loader
(`GlobalBatches` + whole-batch `__getitems__`), channels-last, forward + cross-entropy, backward
under DDP, SGD step, LR scheduler, `zero_grad(set_to_none=True)` and the stop vote
(`trainer.stop.StopVote`: a small asynchronous all-reduce about every 0.2 s of steps). Each
phase is timed with `perf_counter` on every step (`data`, `forward`, `backward` = compute + the all-reduce time DDP could not hide, `optimizer`,
`vote`), and the `baseline` variant is also run under `torch.profiler` to show which operators
and collectives the time is spent in.

Variants, all at 2 ranks on gloo, interleaved `--repeats` times in the same processes:

- `baseline`: DDP as the trainer builds it by default (bucket 25 MiB, gradient_as_bucket_view,
  gloo's event loop at idle priority: `train.gloo_loop_idle`, each rank bound to its share of
  the CPUs: `train.bind_cpus`,
  `static_graph` on: `train.static_graph: auto` on the `cnn` workload), with DDP's built-in
  all-reduce (the trainer's own, timed one is `timed_hook`);
- `dynamic_graph`: the baseline with DDP's own default, `static_graph=False` (the trainer's
  default before `auto`);
- `no_sync`: the same step without any gradient all-reduce (DDP's `no_sync`): the compute-only
  reference, so `backward - no_sync backward` is the exposed communication;
- `bucket_1mb`, `bucket_100mb`, `no_bucket_view`, `fp16_hook`, `bf16_hook` (gradient
  compression hooks), `optim_in_backward` (DDP's fused optimizer: each bucket's SGD step runs
  as soon as its all-reduce is done; not offered by the trainer, docs/trainer.md "DDP settings"),
  `no_vote` (without the stop vote), `torch_buckets` (`bucket_cap_mb` left to torch: its
  1-MiB first bucket starts the all-reduce of the last layers' gradients during the backward;
  an explicit cap, as the trainer passes, puts this model in one bucket), `vote_every_step` (the stop vote at every step boundary,
  the trainer's schedule before 2026-12-04), `timed_hook` (the trainer's all-reduce: torch's
  `allreduce_hook` in Python behind the straggler finder's clock, `trainer.stragglers.BucketClock`,
  instead of DDP's built-in C++ one), `gloo_loop_normal` (gloo's TCP event-loop thread at normal
  priority, as before `train.gloo_loop_idle`; every other variant runs it at SCHED_IDLE, as the
  trainer does: the policy is switched before each chunk, so this needs root or CAP_SYS_NICE to
  go back from idle), `unbound` (the ranks' threads left to the scheduler on all CPUs, as before
  `train.bind_cpus`; every other variant binds rank r to its share of the CPUs as the trainer
  does, switched before each chunk like the loop's policy), each the baseline with that one change.

2-rank scaling efficiency of a variant = its samples/s / (2 x the 1-rank samples/s of the same
step without DDP), the 1-rank run interleaved with the 2-rank ones.

Every rank keeps the memory a step frees, as the trainer does (`train.keep_freed_memory`,
trainer/host.py); `--system-malloc` runs the whole bench with glibc's defaults instead (the
setting is per process, so it cannot be a variant beside the others).

    python bench/step_profile.py [--steps 60] [--repeats 3] [--threads 1] [--system-malloc]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import Result, Stats, fmt, ratio  # noqa: E402

from trainer.host import shares  # noqa: E402
from trainer.stop import StopVote  # noqa: E402

VARIANTS = ["baseline", "torch_buckets", "dynamic_graph", "no_sync", "bucket_1mb", "bucket_100mb", "no_bucket_view",
            "fp16_hook", "bf16_hook", "optim_in_backward", "no_vote", "vote_every_step", "timed_hook",
            "gloo_loop_normal", "unbound"]
PHASES = ["data", "forward", "backward", "optimizer", "vote"]
WARMUP = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(variant: str, world: int, threads: int):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from trainer.config import TrainConfig
    from trainer.data import GlobalBatches, collate
    from trainer.models import build_workload

    cfg = TrainConfig(model="cnn", eval_every_epochs=0, threads=threads)
    w = build_workload(cfg)
    model = w.model.to(memory_format=torch.channels_last)
    rank = torch.distributed.get_rank() if world > 1 else 0
    batches = GlobalBatches(len(w.train_data), 0, rank, world, cfg.batch_size, 1)
    loader = DataLoader(w.train_data, batch_sampler=batches, collate_fn=collate, num_workers=0,
                        generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    ddp = None
    if world > 1:
        ddp = DDP(model, bucket_cap_mb={"bucket_1mb": 1, "bucket_100mb": 100, "torch_buckets": None}.get(variant, 25),
                  gradient_as_bucket_view=variant != "no_bucket_view",
                  # no_sync: torch's static_graph asserts when the first backward skips the all-reduce
                  static_graph=variant not in ("dynamic_graph", "no_sync"))
        if variant in ("fp16_hook", "bf16_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook if variant == "fp16_hook" else default_hooks.bf16_compress_hook
            ddp.register_comm_hook(None, hook)
        if variant == "timed_hook":  # trainer.train: the straggler finder's clock on DDP's all-reduce
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            from trainer.stragglers import BucketClock

            ddp.register_comm_hook(None, BucketClock().wrap(default_hooks.allreduce_hook))
        if variant == "optim_in_backward":
            import warnings

            with warnings.catch_warnings():  # "TorchScript support for functional optimizers is deprecated"
                warnings.simplefilter("ignore", DeprecationWarning)
                ddp._register_fused_optim(torch.optim.SGD, lr=cfg.lr)
            opt = None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if opt is not None else None
    return model, ddp, loader, batches, opt, sched, w.loss_fn


class Variant:
    """One variant's model, DDP wrapper and loader, stepped a chunk at a time."""

    def __init__(self, name: str, world: int, threads: int):
        self.name, self.world = name, world
        self.model, self.ddp, self.loader, self.batches, self.opt, self.sched, self.loss_fn = build(name, world, threads)
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}
        self.stamps: list[float] = []
        self.vote = StopVote(None, world > 1, exact=name == "vote_every_step")  # the trainer's
        self.epoch = 0
        self.batches.start(0)
        self.it = iter(self.loader)
        self.top = None
        self.profiled_steps = 0

    def run(self, steps: int, record: bool = True, profile: bool = False) -> None:
        import contextlib

        import torch

        forward = self.ddp or self.model
        prof = None
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tprofile

            prof = tprofile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
        t_prev = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            try:
                x, y = next(self.it)
            except StopIteration:
                self.epoch += 1
                self.batches.start(self.epoch)
                self.it = iter(self.loader)
                x, y = next(self.it)
            x = x.contiguous(memory_format=torch.channels_last)
            t1 = time.perf_counter()
            ctx = self.ddp.no_sync() if (self.ddp is not None and self.name == "no_sync") else contextlib.nullcontext()
            with ctx:
                loss = self.loss_fn(forward(x), y)
                t2 = time.perf_counter()
                loss.backward()
            t3 = time.perf_counter()
            if self.opt is not None:
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            if self.world > 1 and self.name != "no_vote":
                self.vote.poll(False)
            t5 = time.perf_counter()
            if record:
                for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=False):
                    self.times[p].append(dt)
                self.stamps.append(t5 - t_prev)
            t_prev = t5
        self.vote.close()  # a chunk ends with no collective in flight
        if prof is not None:
            prof.__exit__(None, None, None)
            self.top = [(e.key, e.count, e.cpu_time_total / 1e3, e.self_cpu_time_total / 1e3)
                        for e in prof.key_averages()]
            self.profiled_steps = steps

    def result(self) -> dict:
        n = len(self.stamps)
        return {
            "samples_per_s": 64 * self.world * n / sum(self.stamps),
            "step_ms": 1e3 * sum(self.stamps) / n,
            "phases_ms": {p: 1e3 * sum(v) / n for p, v in self.times.items()},
            "profile": self.top,
            "profiled_steps": self.profiled_steps,
        }


def worker(rank: int, world: int, port: int, steps: int, threads: int, out: str, variants: list[str],
           profile: bool, system_malloc: bool, rounds: int = 4) -> None:
    """Every variant built once, then stepped in `rounds` chunks, round-robin (rotated each
    round), so load that comes and goes on a shared machine hits every variant alike."""
    import torch
    import torch.distributed as dist

    from trainer.host import keep_freed_memory

    torch.set_num_threads(threads)
    if not system_malloc:
        keep_freed_memory(os.environ)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    built: dict[str, Variant] = {}
    results: dict[str, dict] = {}
    for v in variants:
        try:
            built[v] = Variant(v, world, threads)
            built[v].run(WARMUP, record=False)
        except (TypeError, RuntimeError) as e:  # e.g. the bf16 hook needs NCCL: same on every rank
            results[v] = {"error": str(e).splitlines()[0]}
    names = list(built)
    node = sorted(os.sched_getaffinity(0))
    mine = shares(node, world)[rank] if world > 1 and len(node) // world >= threads else None
    chunk = max(1, steps // rounds)
    for i in range(rounds):
        for v in names[i % len(names):] + names[: i % len(names)]:
            if world > 1:
                gloo_loop_policy(v != "gloo_loop_normal")
                bind_threads(node if v == "unbound" or not mine else mine)
            built[v].run(chunk)
            if world > 1:
                dist.barrier()
    if world > 1:
        gloo_loop_policy(True)
        bind_threads(mine or node)
    if profile and "baseline" in built:  # after the timed rounds, untimed: the profiler's overhead
        built["baseline"].run(chunk, record=False, profile=True)  # would count against the baseline
    for v in names:
        results[v] = built[v].result()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    if world > 1:
        dist.destroy_process_group()


def gloo_loop_policy(idle: bool) -> None:
    """This process's gloo event-loop threads at SCHED_IDLE (the trainer's `train.gloo_loop_idle`) or normal."""
    from trainer.host import loop_threads

    for tid in loop_threads():
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))


def bind_threads(cpus: list[int]) -> None:
    """Every thread of this process on `cpus` (the trainer's `train.bind_cpus`, trainer/host.py)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue


def spawn(world: int, steps: int, threads: int, variants: list[str], profile: bool, system_malloc: bool) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.start_processes(worker, args=(world, free_port(), steps, threads, out, variants, profile, system_malloc),
                           nprocs=world, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def categorize(top: list, steps: int) -> list[list]:
    """Profiler rows grouped into the step's parts, ms per step (inclusive times of the
    outermost operator of each part; collectives run on gloo's own thread, overlapped)."""
    groups = {
        "DataLoader next": lambda k: k.startswith("enumerate(DataLoader)"),
        "DDP forward (incl. model)": lambda k: k == "DistributedDataParallel.forward",
        "loss (cross_entropy)": lambda k: k == "aten::cross_entropy_loss",
        "backward: conv": lambda k: k.startswith("autograd::engine::evaluate_function: ConvolutionBackward"),
        "backward: linear (addmm/mm)": lambda k: k.startswith("autograd::engine::evaluate_function: AddmmBackward"),
        "backward: max-pool/relu": lambda k: k.startswith(("autograd::engine::evaluate_function: MaxPool",
                                                          "autograd::engine::evaluate_function: Threshold")),
        "gloo all_reduce (async, overlapped)": lambda k: "all_reduce" in k and k.startswith("gloo"),
        "optimizer step": lambda k: k.startswith("Optimizer.step"),
        "zero_grad": lambda k: k.startswith("Optimizer.zero_grad"),
    }
    rows = []
    for label, match in groups.items():
        hits = [t for t in top if match(t[0])]
        if hits:
            rows.append([label, ", ".join(sorted({h[0][:60] for h in hits}))[:90],
                         f"{sum(h[2] for h in hits) / steps:.2f}"])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--system-malloc", action="store_true", help="glibc's malloc defaults (not the trainer's)")
    args = p.parse_args()
    r = Result("step_profile", "Where a step's time goes (1 vs 2 ranks) and DDP's communication options")
    one: list[dict] = []
    two: dict[str, list[dict]] = {v: [] for v in args.variants}
    errors: dict[str, str] = {}
    for i in range(args.repeats):
        one.append(spawn(1, args.steps, args.threads, ["baseline"], False, args.system_malloc)["baseline"])
        res = spawn(2, args.steps, args.threads, args.variants, i == 0, args.system_malloc)
        for v in args.variants:
            if "error" in res[v]:
                errors[v] = res[v]["error"]
            else:
                two[v].append(res[v])
        print(f"  repeat {i + 1}/{args.repeats}: 1 rank {one[-1]['samples_per_s']:.0f} samples/s; 2 ranks "
              + ", ".join(f"{v} {two[v][-1]['samples_per_s']:.0f}" for v in args.variants if two[v]), flush=True)
    for v, e in errors.items():
        r.note(f"variant {v} is not available here: {e}")
    variants = [v for v in args.variants if two[v]]

    def st(runs: list[dict], key: str, phase: str | None = None) -> Stats:
        return Stats([x["phases_ms"][phase] if phase else x[key] for x in runs])

    base1 = st(one, "samples_per_s")
    malloc = "glibc's defaults" if args.system_malloc else "the trainer's (freed memory kept)"
    r.text(
        f"The trainer's step on the `cnn` workload (batch 64 per rank, {args.threads} thread(s) per "
        f"rank, gloo), {args.steps} timed steps after {WARMUP} warm-up steps, {args.repeats} "
        f"interleaved repeats, malloc as {malloc}; every phase timed on every step with `perf_counter` (rank 0). "
        "`backward` includes the all-reduce time DDP could not hide behind the backward pass; "
        "`no_sync` is the same step with no all-reduce at all, so the difference of the two "
        "backward columns is the exposed communication.")
    rows = [["1 rank, no DDP", st(one, "step_ms").fmt(".1f"),
             *(st(one, "", ph).fmt(".1f") for ph in PHASES), base1.fmt(".0f"), "-"]]
    for v in variants:
        effs = Stats([b["samples_per_s"] / (2 * a["samples_per_s"]) for a, b in zip(one, two[v], strict=False)])
        rows.append([f"2 ranks, {v}", st(two[v], "step_ms").fmt(".1f"),
                     *(st(two[v], "", ph).fmt(".1f") for ph in PHASES),
                     st(two[v], "samples_per_s").fmt(".0f"), effs.fmt(".3f")])
    r.table("ms per step, median (min-max) of the repeats; efficiency = samples/s / (2 x 1-rank samples/s)",
            ["step", "total ms", *(f"{ph} ms" for ph in PHASES), "samples/s", "2-rank efficiency"], rows)
    cats = ["1 rank"] + [f"2r {v}" for v in variants]
    r.chart("step_profile_phases.png", "ms per step by phase (median)", "ms per step", cats,
            {ph: [st(one, "", ph)["median"]] + [st(two[v], "", ph)["median"] for v in variants]
             for ph in PHASES}, kind="stacked")
    prof = two.get("baseline", [{}])[0].get("profile") if "baseline" in two else None
    if prof:
        steps = two["baseline"][0]["profiled_steps"]
        r.table("torch.profiler, 2 ranks, baseline, rank 0: ms per step (inclusive CPU time)",
                ["part", "operators", "ms/step"], categorize(prof, steps))
        top = sorted(prof, key=lambda t: -t[3])[:12]
        r.table("torch.profiler, 2 ranks, baseline, rank 0: top operators by self CPU time",
                ["operator", "calls/step", "self ms/step", "total ms/step"],
                [[k[:70], f"{c / steps:.1f}", f"{s / steps:.2f}", f"{t / steps:.2f}"] for k, c, t, s in top])
    if "no_sync" in two and "baseline" in two:
        exposed = Stats([a["phases_ms"]["backward"] - b["phases_ms"]["backward"]
                         for a, b in zip(two["baseline"], two["no_sync"], strict=False)])
        r.note(f"exposed all-reduce per step (baseline backward - no_sync backward): {exposed.fmt('.1f', ' ms')}")
        slow = Stats([b["phases_ms"]["backward"] / a["phases_ms"]["backward"] for a, b in zip(one, two["no_sync"], strict=False)])
        r.note(f"backward at 2 ranks without any all-reduce / backward at 1 rank: {slow.fmt('.2f')} "
               "(two ranks' compute competing for the machine's cores)")
    best = max(variants, key=lambda v: st(two[v], "samples_per_s")["median"] if v != "no_sync" else 0)
    r.note(f"fastest 2-rank variant with all-reduce: {best} "
           f"({fmt(ratio(st(two[best], 'samples_per_s')['median'], st(two['baseline'], 'samples_per_s')['median']) if 'baseline' in two else None, '.3f')}x baseline)")
    r.doc["data"] = {"one_rank": [{k: v for k, v in x.items() if k != "profile"} for x in one],
                     "two_ranks": {v: [{k: w for k, w in x.items() if k != "profile"} for x in runs]
                                   for v, runs in two.items()}}
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
