"""The cost of counting a script's steps (trainer/script_steps.py): the same script, timed by
itself, under bare torchrun and under ddpkit's launcher (trainer.guard's optimizer-step hook and
rank 0's progress record), interleaved.

The script is a small DDP loop on CPU (2 ranks, gloo; a 256x256 linear layer, batch 32) so the
hook's share of a step shows: a real model's step is longer, the hook's cost the same. Each run
prints its steady-state seconds per step (the first 50 steps left out); reported: the median
per variant and the ratio ddpkit / bare. Goal: under 1% of a step.

Also timed, in one process: the straggler clock's share (a post-accumulate-grad hook per
parameter tensor, trainer/script_steps.py) on a 100-tensor model's forward and backward, with
and without the hooks, interleaved: the cost per tensor.

    python bench/script_steps.py [--repeats 5] [--steps 600]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_common import Result, fmt  # noqa: E402
from gpu_bench import free_port  # noqa: E402

SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 256)
steps, warm = int(sys.argv[1]), 50
for i in range(steps):
    if i == warm:
        t0 = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
if dist.get_rank() == 0:
    print(f"seconds-per-step {(time.perf_counter() - t0) / (steps - warm):.9f}", flush=True)
dist.destroy_process_group()
"""


def run(argv: list[str], work: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def per_step(out: str) -> float:
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("seconds-per-step ")))


def bare(work: Path, steps: int) -> float:
    return per_step(run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-port", str(free_port()), "train.py", str(steps)], work,
                        {**os.environ, "OMP_NUM_THREADS": "1"}))


def ours(work: Path, steps: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DDPKIT_JOB_FILE": str(work / "job.yaml"),
           "DDPKIT_NPROC_PER_NODE": "2", "DDPKIT_MASTER_PORT": str(free_port())}
    return per_step(run([sys.executable, "-m", "trainer.launch"], work, env))


def gradient_hook_cost(repeats: int = 15, tensors: int = 100) -> tuple[float, float]:
    """Median seconds of one forward+backward of a `tensors`-tensor MLP without and with a
    post-accumulate-grad hook on every tensor (what the straggler clock adds), interleaved."""
    import time

    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(tensors // 2)])
    x = torch.randn(8, 64)
    noted = [0.0]

    def note(param) -> None:  # what ScriptSteps._gradient_ready does
        noted[0] = time.time()

    def timed(n: int = 200) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            model(x).sum().backward()
        return (time.perf_counter() - t0) / n

    off, on = [], []
    for _ in range(repeats):
        off.append(timed())
        hooks = [p.register_post_accumulate_grad_hook(note) for p in model.parameters()]
        on.append(timed())
        for hook in hooks:
            hook.remove()
    return statistics.median(off), statistics.median(on)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    args = p.parse_args()
    r = Result("script_steps", "Counting a script's steps: bare torchrun vs ddpkit's launcher (hook + progress record)")
    times: dict[str, list[float]] = {"bare torchrun": [], "ddpkit (hook + record)": []}
    with tempfile.TemporaryDirectory(prefix="ddpkit-script-steps-") as tmp:
        work = Path(tmp)
        (work / "train.py").write_text(SCRIPT)
        (work / "job.yaml").write_text(f"name: steps\nscript: train.py\nargs: ['{args.steps}']\n")
        for _ in range(args.repeats):
            times["bare torchrun"].append(bare(work, args.steps))
            times["ddpkit (hook + record)"].append(ours(work, args.steps))
    base = statistics.median(times["bare torchrun"])
    rows = [[name, fmt(statistics.median(v) * 1e3, ".3f"), fmt(min(v) * 1e3, ".3f"), fmt(max(v) * 1e3, ".3f"),
             fmt(statistics.median(v) / base, ".3f")] for name, v in times.items()]
    r.text(f"2 ranks, gloo on CPU, {args.steps} steps (50 left out), {args.repeats} interleaved runs each; "
           "the script times its own steps.")
    r.table("milliseconds per step (median, min, max) and the ratio to bare torchrun",
            ["variant", "median ms", "min ms", "max ms", "ratio"], rows)
    off, on = gradient_hook_cost()
    r.table("the straggler clock: one forward+backward of a 100-tensor MLP (64x64 layers, batch 8, "
            "1 thread), median of 15 interleaved runs of 200",
            ["without hooks us", "with a hook per tensor us", "per tensor ns", "ratio"],
            [[fmt(off * 1e6, ".1f"), fmt(on * 1e6, ".1f"), fmt((on - off) / 100 * 1e9, ".0f"), fmt(on / off, ".3f")]])
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
