"""`nn.DataParallel` in one process vs DDP with one process per device, same workload and data.

Both train the `cnn` workload (its model and synthetic data, SGD, cross-entropy) on the same
global batch (`--batch` per device x devices), interleaved `--repeats` times:

- DataParallel: one process, `nn.DataParallel(model)`; it scatters each batch over the visible
  GPUs, runs a replica per GPU in threads and gathers the outputs on the first. Without GPUs it
  has no device ids and calls the module directly: nothing is split, one process computes the
  whole global batch (with all the machine's cores as threads);
- DDP: one process per device (a GPU, or on CPU one per core with 1 thread each), each on its
  own shard (`DistributedSampler`), gradients all-reduced (gloo on CPU, nccl on GPU).

A forward pre-hook records the batch size each model replica actually sees and where it runs,
so the table *shows* what DataParallel does on this machine.

    python bench/dp_vs_ddp.py [--steps 60] [--repeats 3] [--device cpu|cuda] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import Result, Stats, fmt, ratio  # noqa: E402

WARMUP = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(world: int, rank: int, batch: int, device):
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from trainer.data import collate, synthetic_images
    from trainer.models import make_cnn

    train, _ = synthetic_images(held_out=False)
    torch.manual_seed(0)
    model = make_cnn().to(device)
    seen: list[tuple[int, str, str]] = []  # (batch rows, device, thread) per replica call

    def hook(module, inputs):
        x = inputs[0]
        seen.append((int(x.shape[0]), str(x.device), threading.current_thread().name))

    model.register_forward_pre_hook(hook)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=batch, sampler=sampler, collate_fn=collate, drop_last=True)
    return model, loader, sampler, seen


def train_loop(model, loader, sampler, steps: int, device) -> float:
    """samples/s over `steps` steps after WARMUP (the global batch is whatever a loader yields)."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler.set_epoch(0)
    it, epoch, done, t0, samples = iter(loader), 0, 0, None, 0
    while done < steps + WARMUP:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            continue
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        done += 1
        if done == WARMUP:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        elif done > WARMUP:
            samples += len(y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - t0)


def dp_worker(_: int, steps: int, batch: int, devices: int, threads: int, use_cuda: bool, out: str) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    model, loader, sampler, seen = setup(1, 0, batch * devices, device)
    dp = nn.DataParallel(model)
    sps = train_loop(dp, loader, sampler, steps, device)
    Path(out).write_text(json.dumps({"samples_per_s": sps, "seen": seen[-max(1, len(dp.device_ids)):],
                                     "device_ids": dp.device_ids, "threads": torch.get_num_threads()}))


def ddp_worker(rank: int, world: int, port: int, steps: int, batch: int, threads: int, use_cuda: bool,
               out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    model, loader, sampler, seen = setup(world, rank, batch, device)
    ddp = DDP(model, device_ids=[rank] if use_cuda else None)
    sps_local = train_loop(ddp, loader, sampler, steps, device)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"samples_per_s": sps_local, "seen": seen[-1]})
    if rank == 0:
        Path(out).write_text(json.dumps({"samples_per_s": sum(g["samples_per_s"] for g in gathered),
                                         "seen": [g["seen"] for g in gathered]}))
    dist.destroy_process_group()


def spawn(fn, nprocs: int, args: tuple) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.start_processes(fn, args=(*args, out), nprocs=nprocs, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="samples per device per step")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--name", default=None, help="result name (default dp_vs_ddp, dp_vs_ddp_gpu on cuda)")
    args = p.parse_args()
    import torch

    use_cuda = args.device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    cores = len(os.sched_getaffinity(0))
    devices = torch.cuda.device_count() if use_cuda else min(2, cores)
    name = args.name or ("dp_vs_ddp_gpu" if use_cuda else "dp_vs_ddp")
    r = Result(name, f"DataParallel vs DistributedDataParallel ({args.device})")
    dp_runs, ddp_runs = [], []
    for i in range(args.repeats):
        # DataParallel gets the whole machine: every core as a thread (CPU) or every GPU.
        dp_runs.append(spawn(dp_worker, 1, (args.steps, args.batch, devices, cores, use_cuda)))
        ddp_runs.append(spawn(ddp_worker, devices, (devices, free_port(), args.steps, args.batch,
                                                    1 if not use_cuda else max(1, cores // devices), use_cuda)))
        print(f"  repeat {i + 1}/{args.repeats}: DataParallel {dp_runs[-1]['samples_per_s']:.0f}, "
              f"DDP {ddp_runs[-1]['samples_per_s']:.0f} samples/s", flush=True)
    dp, ddp = Stats([x["samples_per_s"] for x in dp_runs]), Stats([x["samples_per_s"] for x in ddp_runs])
    seen_dp, seen_ddp = dp_runs[-1]["seen"], ddp_runs[-1]["seen"]
    global_batch = args.batch * devices
    where = (f"{devices} GPU(s) ({torch.cuda.get_device_name(0)})" if use_cuda
             else f"CPU, {cores} cores, no GPU")
    r.text(
        f"The `cnn` workload, global batch {global_batch} ({args.batch} per device x {devices} devices), "
        f"SGD, {args.steps} timed steps after {WARMUP} warm-up, {args.repeats} interleaved repeats, on {where}. "
        "DataParallel: one process (CPU: all cores as threads). DDP: one process per device "
        f"({'nccl' if use_cuda else 'gloo, 1 thread each'}). samples/s counts the global batch.")
    if not use_cuda:
        r.text(
            "**On CPU DataParallel splits nothing.** With no GPU its `device_ids` list is empty "
            f"(here: `{dp_runs[-1]['device_ids']}`) and `forward` calls the wrapped module directly, "
            "so there is one replica and it sees the whole global batch, as the recorded per-replica "
            "batch sizes below show; the only parallelism is PyTorch's intra-op threads. DDP runs one "
            "process per core, each on its own half of the batch.")
    r.table("what each model replica sees in forward (a forward pre-hook, last step)",
            ["mode", "replicas per step", "batch rows per replica", "replica device", "runs in"], [
                ["DataParallel", len(seen_dp), ", ".join(str(s[0]) for s in seen_dp),
                 ", ".join(sorted({s[1] for s in seen_dp})), ", ".join(sorted({s[2] for s in seen_dp}))],
                ["DDP", len(seen_ddp), ", ".join(str(s[0]) for s in seen_ddp),
                 ", ".join(sorted({s[1] for s in seen_ddp})), f"{devices} processes"],
            ])
    r.table("samples/s, median (min-max, n)", ["mode", "samples/s", "vs DataParallel"], [
        ["DataParallel (1 process)", dp.fmt(".0f"), "1.00"],
        [f"DDP ({devices} processes)", ddp.fmt(".0f"), fmt(ratio(ddp["median"], dp["median"]), ".2f")],
    ])
    r.chart(f"{name}.png", f"DataParallel vs DDP, {args.device} (median, min-max)", "samples/s",
            ["DataParallel", "DDP"], {"samples/s": [dp["median"], ddp["median"]]},
            low={"samples/s": [dp["min"], ddp["min"]]}, high={"samples/s": [dp["max"], ddp["max"]]})
    r.doc["data"] = {"dataparallel": dp_runs, "ddp": ddp_runs, "devices": devices}
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
