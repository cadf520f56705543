"""The GPU figures (run by `bench/gpu.sh`): our trainer vs an fp32 textbook DDP loop on one GPU.

For the `gpt` and `cnn` workloads, on one NVIDIA GPU with NCCL (one process, world size 1,
through torchrun like every target):

- the textbook loop: DistributedSampler, DDP, fp32, no compile, zero_grad/backward/step (the
  workload's model and data, nothing else of ddpkit);
- ours (`python -m trainer.launch`): precision fp32 and bf16 autocast, `torch.compile` off and
  on.

Reported: samples/s (and tokens/s for gpt) from the steady state, the ratio to the fp32
textbook loop, and MFU = model FLOPs per step (counted by `torch.utils.flop_counter` on one
forward + backward) x steps/s / the GPU's dense bf16 peak (a table of known GPUs below; MFU
is left out for a GPU not in it, or set `--peak-tflops`).

    python bench/gpu_bench.py [--quick] [--cpu-check]

`--cpu-check` runs the same code shrunk to tiny models on CPU with gloo (fp32/bf16, compile
off): a dry check of this script on a machine without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))  # the trainer, also for a Python without ddpkit installed (bench/gpu.sh)

from bench_common import Result, fmt, ratio  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; SXM parts where there are two).
PEAK_BF16_TFLOPS = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0,
    "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A800": 312.0, "A30": 165.0, "A10G": 70.0,
    "A10": 125.0, "L40S": 362.0, "L40": 181.0, "L4": 121.0, "RTX 4090": 165.0, "RTX 6000 Ada": 364.0,
    "RTX A6000": 155.0, "RTX 3090": 71.0,
}

# gpt sized for a GPU (about GPT-2 small without its vocabulary); cnn with a bigger batch.
WORKLOADS = {
    "gpt": {"model": "gpt", "batch_size": 16, "optimizer": "adamw", "lr": 3e-4,
            "model_args": {"d_model": 768, "layers": 12, "heads": 12, "seq_len": 1024, "vocab": 256, "samples": 2048}},
    "cnn": {"model": "cnn", "batch_size": 256},
}
TINY = {
    "gpt": {"model": "gpt", "batch_size": 4, "optimizer": "adamw", "lr": 3e-4,
            "model_args": {"d_model": 32, "layers": 1, "heads": 2, "seq_len": 16, "vocab": 64, "samples": 512}},
    "cnn": {"model": "cnn", "batch_size": 16, "data_samples": 2048},
}


def peak_for(name: str | None) -> float | None:
    if not name:
        return None
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return PEAK_BF16_TFLOPS[key]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "DDPKIT_"))}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


# -- the textbook loop (a worker under torchrun) ------------------------------------------
def textbook_worker(train: dict, steps: int, device_kind: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from trainer.config import TrainConfig
    from trainer.models import build_workload

    use_cuda = device_kind == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    cfg = TrainConfig(**{**train, "eval_every_epochs": 0})
    w = build_workload(cfg)  # the workload's model and data; the loop below is the textbook's
    model = DDP(w.model.to(device), device_ids=[local] if use_cuda else None)
    data = TensorDataset(w.train_data.x, w.train_data.y)  # the built-in data sets are tensor pairs
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, drop_last=True, pin_memory=use_cuda)
    opt = (torch.optim.AdamW(model.parameters(), lr=cfg.lr) if cfg.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=cfg.lr))
    done, epoch, warm, t0 = 0, 0, min(20, steps // 4), None
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = w.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            done += 1
            if done == warm:
                if use_cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            if done >= steps:
                break
        epoch += 1
    if use_cuda:
        torch.cuda.synchronize()
    sps = (steps - warm) * cfg.batch_size * dist.get_world_size() / (time.perf_counter() - t0)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"samples_per_s": sps, "loss": loss.item()}))
    dist.destroy_process_group()


def run_textbook(train: dict, steps: int, device: str, work: Path, timeout: int) -> dict:
    out = work / "textbook.json"
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import gpu_bench; "
            f"gpu_bench.textbook_worker(json.loads(sys.argv[1]), {steps}, {device!r}, {str(out)!r})")
    wrapper = work / "textbook_main.py"
    wrapper.write_text(code + "\n")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                    "--master-port", str(free_port()), str(wrapper), json.dumps(train)],
                   cwd=work, env=env_for(device), check=True, capture_output=True, timeout=timeout)
    return json.loads(out.read_text())


def run_ours(train: dict, steps: int, device: str, precision: str, compile_: bool, work: Path, name: str,
             timeout: int) -> dict:
    import yaml

    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "train": {
        **train, "max_steps": steps, "eval_every_epochs": 0, "plot": False, "device": device,
        "precision": precision, "compile": compile_, "log_every_steps": 50}}))
    env = {**env_for(device), "DDPKIT_JOB_FILE": str(job), "DDPKIT_NPROC_PER_NODE": "1",
           "DDPKIT_MASTER_PORT": str(free_port()), "DDPKIT_LAUNCH_T0": repr(time.time())}
    proc = subprocess.run([sys.executable, "-m", "trainer.launch"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    s = json.loads((work / "runs" / name / "metrics.jsonl").read_text().splitlines()[-1])
    return {"samples_per_s": s["samples_per_s"], "first_step_s": s["first_step_s"], "final_loss": s["final_loss"]}


def flops_per_step(train: dict, device: str) -> float | None:
    """Model FLOPs of one forward + backward at the job's batch size (torch.utils.flop_counter)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.config import TrainConfig
    from trainer.models import build_workload

    cfg = TrainConfig(**{**train, "eval_every_epochs": 0})
    w = build_workload(cfg)
    model = w.model.to(device)
    x, y = w.train_data.__getitems__(list(range(cfg.batch_size)))
    x, y = x.to(device), y.to(device)
    counter = FlopCounterMode(display=False)
    with counter:
        w.loss_fn(model(x), y).backward()
    total = counter.get_total_flops()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return float(total) if total else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-check", action="store_true", help="tiny models on CPU: check the script, not the GPU")
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--workloads", nargs="+", default=["gpt", "cnn"], choices=["gpt", "cnn"])
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: from a table)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    p.add_argument("--budget", type=int, default=330, help="seconds for everything: later runs are skipped")
    args = p.parse_args()
    import torch

    device = "cpu" if args.cpu_check else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: torch sees no CUDA device (torch.cuda.is_available() is False); "
                         "use --cpu-check for a dry run on CPU")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    peak = args.peak_tflops or peak_for(gpu)
    r = Result("gpu_cpu_check" if args.cpu_check else "gpu",
               "GPU: our trainer vs the fp32 textbook loop (bf16, torch.compile)" +
               (" — CPU dry check, figures meaningless" if args.cpu_check else ""))
    specs = TINY if args.cpu_check else WORKLOADS
    steps = {"gpt": 12 if args.cpu_check else (60 if args.quick else 120),
             "cnn": 12 if args.cpu_check else (150 if args.quick else 300)}
    configs = [("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True)]
    if args.cpu_check:
        configs = [("fp32", False), ("bf16", False)]  # compile on CPU needs a C++ compiler and minutes
    rows, chart = [], {}
    t_start = time.time()
    for wl in args.workloads:
        train = specs[wl]
        seq = train.get("model_args", {}).get("seq_len") if wl == "gpt" else None
        unit = "tokens/s" if seq else "samples/s"
        per = seq or 1
        fl = flops_per_step(train, device)
        with tempfile.TemporaryDirectory(prefix="ddpkit-gpu-bench-") as tmp:
            work = Path(tmp)
            try:
                base = run_textbook(train, steps[wl], device, work, args.timeout)["samples_per_s"]
            except (subprocess.SubprocessError, OSError) as e:
                r.note(f"{wl}: the textbook loop failed: {e}")
                base = None
            results = [("textbook loop, fp32, no compile", base, None)]
            for precision, comp in configs:
                label = f"ddpkit, {precision}, compile {'on' if comp else 'off'}"
                left = args.budget - (time.time() - t_start)
                if left < 20:
                    r.note(f"{wl} {label}: skipped, over the {args.budget} s budget")
                    results.append((label, None, None))
                    continue
                try:
                    o = run_ours(train, steps[wl], device, precision, comp, work, f"{wl}-{precision}-{int(comp)}",
                                 int(min(args.timeout, left)))
                    results.append((label, o["samples_per_s"], o["first_step_s"]))
                except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                    r.note(f"{wl} {label}: failed: {str(e)[:300]}")
                    results.append((label, None, None))
                print(f"  {wl}: {label}: {fmt(results[-1][1], '.0f')} samples/s "
                      f"({time.time() - t_start:.0f} s so far)", flush=True)
        batch = train["batch_size"]
        for label, sps, first in results:
            mfu = (fl * sps / batch / (peak * 1e12)) if (fl and sps and peak) else None
            rows.append([wl, label, fmt(sps * per if sps else None, ".0f") + f" {unit}",
                         fmt(ratio(sps, base), ".2f"), fmt(mfu, ".1%"), fmt(first, ".1f")])
        chart[wl] = [ratio(sps, base) for _, sps, _ in results]
    r.text(
        f"{'CPU dry check (tiny models, gloo)' if args.cpu_check else f'One GPU: {gpu}, NCCL, one process'}; "
        f"torch {torch.__version__}. gpt: {specs['gpt'].get('model_args')} batch {specs['gpt']['batch_size']}; "
        f"cnn: batch {specs['cnn']['batch_size']}. Steady-state throughput (the first steps, compilation "
        "included, excluded); one run each. MFU = model FLOPs per step x steps/s / dense bf16 peak; the "
        "FLOPs are torch.utils.flop_counter's count of one forward + backward: 2 per multiply-add of every "
        "matmul, convolution and attention product (attention at its full, unmasked size), nothing for "
        f"elementwise ops, no activation recomputation (peak {fmt(peak, '.0f')} TFLOP/s"
        f"{'' if peak else ': GPU not in the table, MFU not computed'}); ratio = / the fp32 textbook loop.")
    r.table("throughput and MFU", ["workload", "run", "throughput", "vs fp32 textbook", "MFU", "first step, s"], rows)
    labels = ["textbook fp32"] + [f"{p}{' +compile' if c else ''}" for p, c in configs]
    r.chart(f"{r.doc['name']}.png", "throughput / fp32 textbook loop", "ratio", labels, chart)
    r.doc["data"] = {"gpu": gpu, "peak_bf16_tflops": peak, "rows": rows}
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
