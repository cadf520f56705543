"""ddpkit's trainer against the textbook DDP loop on the `cnn` workload, side by side.

Both train the same data, model and optimizer (the `cnn` workload's definition) with 1 thread
per rank, at 1 and 2 ranks, under the same launcher (torchrun; ours through
`python -m trainer.launch`, exactly as every target starts it). Each pair runs interleaved
`--repeats` times and the medians are reported, because the machine may be shared. Printed:

- samples/s (steady state: first 20 steps excluded) and the ratio ours/textbook
  (goal >= 1.0: the kit costs nothing);
- 2-rank scaling efficiency = samples/s at 2 ranks / (2 x samples/s at 1 rank);
- launch-to-first-step seconds (from starting the launcher process to the end of step 1).

Ours runs with its defaults for this job, checkpoints included (every 200 steps and at the
end); evaluation and the plot are off because the textbook loop has neither.

    python bench/trainer_vs_textbook.py [--steps 200] [--repeats 3]

GPU: `--device cuda [--model gpt]` times ours alone on CUDA (nccl, bf16 autocast): the
textbook loop is the CPU reference. Ready, but not measured in this repository's sessions
(no GPU was available).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "DDPKIT_"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)})
    return env


def run_textbook(work: Path, nproc: int, steps: int, threads: int) -> dict:
    out = work / f"textbook-{nproc}.json"
    env = {**base_env(threads), "DDPKIT_LAUNCH_T0": repr(time.time())}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--master-port", str(free_port()), str(REPO / "bench" / "textbook_ddp.py"),
                    str(out), str(steps), str(threads)],
                   cwd=work, env=env, check=True, capture_output=True)
    r = json.loads(out.read_text())
    return {"samples_per_s": r["samples_per_s"], "first_step_s": r["first_step_s"]}


def run_ours(work: Path, nproc: int, steps: int, threads: int, device: str, i: int, model: str) -> dict:
    name = f"ours-{nproc}-{i}"
    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "train": {
        "model": model, "max_steps": steps, "threads": threads, "eval_every_epochs": 0,
        "plot": False, "device": device, "log_every_steps": 50}}))
    env = {**base_env(threads), "DDPKIT_JOB_FILE": str(job), "DDPKIT_NPROC_PER_NODE": str(nproc),
           "DDPKIT_MASTER_PORT": str(free_port()), "DDPKIT_LAUNCH_T0": repr(time.time())}
    subprocess.run([sys.executable, "-m", "trainer.launch"], cwd=work, env=env, check=True,
                   capture_output=True)
    lines = (work / "runs" / name / "metrics.jsonl").read_text().splitlines()
    s = json.loads(lines[-1])
    return {"samples_per_s": s["samples_per_s"], "first_step_s": s["first_step_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="cnn", choices=["cnn", "gpt"], help="gpt: ours alone")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="rank counts to run")
    args = p.parse_args()
    textbook = args.device == "cpu" and args.model == "cnn"
    if not textbook:
        print("note: the textbook loop is the cnn workload on CPU/gloo; timing ours alone")
    results: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as tmp:
        work = Path(tmp)
        for i in range(args.repeats):
            for nproc in args.nproc:
                if textbook:
                    results.setdefault(("textbook", nproc), []).append(
                        run_textbook(work, nproc, args.steps, args.threads))
                results.setdefault(("ddpkit", nproc), []).append(
                    run_ours(work, nproc, args.steps, args.threads, args.device, i, args.model))
                print(f"  repeat {i + 1}/{args.repeats}, {nproc} rank(s): " + ", ".join(
                    f"{k} {v[-1]['samples_per_s']:.0f} samples/s" for (k, n), v in results.items() if n == nproc),
                    flush=True)

    def med(kind: str, nproc: int, key: str) -> float | None:
        runs = results.get((kind, nproc))
        return statistics.median(r[key] for r in runs) if runs else None

    print(f"\n{args.model} workload, {args.steps} steps, batch 64 per rank, {args.threads} thread(s) "
          f"per rank, {args.device}, median of {args.repeats}\n")

    def cell(v: float | None, fmt: str) -> str:
        return format(v, fmt) if v is not None else "-"

    print(f"{'':30}{'textbook':>10}{'ddpkit':>10}{'ratio':>8}")
    for nproc in args.nproc:
        t, o = med("textbook", nproc, "samples_per_s"), med("ddpkit", nproc, "samples_per_s")
        print(f"{f'samples/s, {nproc} rank(s)':30}{cell(t, '.0f'):>10}{cell(o, '.0f'):>10}"
              f"{cell(o / t if t and o else None, '.3f'):>8}")
    if 1 in args.nproc and 2 in args.nproc:
        eff = {k: med(k, 2, "samples_per_s") / (2 * med(k, 1, "samples_per_s"))
               if med(k, 1, "samples_per_s") else None for k in ("textbook", "ddpkit")}
        print(f"{'2-rank scaling efficiency':30}{cell(eff['textbook'], '.3f'):>10}{cell(eff['ddpkit'], '.3f'):>10}")
    for nproc in args.nproc:
        t, o = med("textbook", nproc, "first_step_s"), med("ddpkit", nproc, "first_step_s")
        print(f"{f'launch to first step, {nproc}r (s)':30}{cell(t, '.2f'):>10}{cell(o, '.2f'):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
