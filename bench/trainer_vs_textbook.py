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
end); evaluation and the plot are off because the textbook loop has neither, and `epochs: 100`
lets `--steps` end both (the textbook loop runs epochs until then).

    python bench/trainer_vs_textbook.py [--steps 200] [--repeats 3] [--baseline TREE] [--textbook-kept-memory]

`--baseline TREE` (an earlier source tree: `git archive COMMIT | tar -x -C TREE`) runs that
tree's trainer too, as a third column interleaved with the other two: before and after in one run.
`--textbook-kept-memory` runs the textbook loop a second time with ours' malloc thresholds
(`train.keep_freed_memory`, given to it as `GLIBC_TUNABLES`), interleaved: what the loop itself
would gain from the setting, beside what ours gains.

GPU: `--device cuda [--model gpt]` times ours alone on CUDA (nccl, bf16 autocast): the
textbook loop is the CPU reference. Ready, but not measured in this repository's sessions
(no GPU was available).
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

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Result, Stats, fmt, ratio  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(threads: int, tree: Path = REPO) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "DDPKIT_"))}
    env.update({"PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)})
    return env


def run_textbook(work: Path, nproc: int, steps: int, threads: int, kept_memory: bool = False) -> dict:
    out = work / f"textbook-{nproc}.json"
    env = {**base_env(threads), "DDPKIT_LAUNCH_T0": repr(time.time())}
    if kept_memory:  # trainer/host.py's thresholds, as glibc tunables (read when python starts)
        from trainer.host import MMAP_THRESHOLD, TRIM_THRESHOLD

        env["GLIBC_TUNABLES"] = (f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:"
                                 f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--master-port", str(free_port()), str(REPO / "bench" / "textbook_ddp.py"),
                    str(out), str(steps), str(threads)],
                   cwd=work, env=env, check=True, capture_output=True)
    r = json.loads(out.read_text())
    return {"samples_per_s": r["samples_per_s"], "first_step_s": r["first_step_s"]}


def run_ours(work: Path, nproc: int, steps: int, threads: int, device: str, i: int, model: str,
             tree: Path = REPO) -> dict:
    name = f"ours-{nproc}-{i}" + ("" if tree == REPO else "-baseline")
    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "train": {
        "model": model, "max_steps": steps, "epochs": 100, "threads": threads, "eval_every_epochs": 0,
        "plot": False, "device": device, "log_every_steps": 50}}))
    env = {**base_env(threads, tree), "DDPKIT_JOB_FILE": str(job), "DDPKIT_NPROC_PER_NODE": str(nproc),
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
    p.add_argument("--baseline", type=Path, help="an earlier source tree, run as a third column")
    p.add_argument("--textbook-kept-memory", action="store_true",
                   help="also the textbook loop with ours' malloc thresholds, as a column")
    args = p.parse_args()
    r = Result("trainer_vs_textbook", "Our trainer vs the textbook DDP loop")
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
                if args.baseline:
                    results.setdefault(("baseline", nproc), []).append(run_ours(
                        work, nproc, args.steps, args.threads, args.device, i, args.model, args.baseline.resolve()))
                if textbook and args.textbook_kept_memory:
                    results.setdefault(("textbook_kept", nproc), []).append(
                        run_textbook(work, nproc, args.steps, args.threads, kept_memory=True))
                print(f"  repeat {i + 1}/{args.repeats}, {nproc} rank(s): " + ", ".join(
                    f"{k} {v[-1]['samples_per_s']:.0f} samples/s" for (k, n), v in results.items() if n == nproc),
                    flush=True)

    kinds = [k for k in ("textbook", "ddpkit", "baseline", "textbook_kept") if any(kk == k for kk, _ in results)]

    def stats(kind: str, nproc: int, key: str) -> Stats:
        return Stats([x[key] for x in results.get((kind, nproc), [])])

    def effs(kind: str) -> Stats:  # per repeat: the 2-rank and 1-rank runs of the same round
        one, two = results.get((kind, 1), []), results.get((kind, 2), [])
        return Stats([b["samples_per_s"] / (2 * a["samples_per_s"]) for a, b in zip(one, two, strict=False)])

    r.text(f"The `{args.model}` workload, {args.steps} steps, batch 64 per rank, {args.threads} "
           f"thread(s) per rank, {args.device}, gloo, torchrun for both (ours through "
           f"`python -m trainer.launch`), {args.repeats} interleaved repeats. samples/s is the "
           "steady state (the first 20 steps excluded); launch to first step is from starting the "
           "launcher process to the end of optimizer step 1. Ours runs with its defaults "
           "(channels-last, freed memory kept for reuse, gloo's event loop at idle priority, each rank bound "
           "to its share of the CPUs, checkpoints every 200 steps and at the end).")
    base = [k for k in ("baseline", "textbook_kept") if k in kinds]
    headers = {"baseline": f"ddpkit at {args.baseline.name} (before)" if args.baseline else "",
               "textbook_kept": "textbook, malloc as ours"}

    def row(label: str, figures: dict[str, Stats], spec: str) -> list[str]:
        t, o = figures["textbook"], figures["ddpkit"]
        return [label, t.fmt(spec), o.fmt(spec), fmt(ratio(o["median"], t["median"]), ".2f"),
                *(x for b in base for x in (figures[b].fmt(spec), fmt(ratio(figures[b]["median"], t["median"]), ".2f")))]

    rows = []
    for nproc in args.nproc:
        rows.append(row(f"samples/s, {nproc} rank(s)",
                        {k: stats(k, nproc, "samples_per_s") for k in ("textbook", "ddpkit", *base)}, ".0f"))
    if 1 in args.nproc and 2 in args.nproc:
        rows.append(row("2-rank scaling efficiency", {k: effs(k) for k in ("textbook", "ddpkit", *base)}, ".3f"))
    for nproc in args.nproc:
        rows.append(row(f"launch to first step, {nproc} rank(s), s",
                        {k: stats(k, nproc, "first_step_s") for k in ("textbook", "ddpkit", *base)}, ".2f"))
    columns = ["figure", "textbook", "ddpkit", "ratio"] + [c for b in base for c in (headers[b], "ratio")]
    r.table("median (min-max, n repeats); ratio = ddpkit / textbook" + (
        f"; ddpkit at {args.baseline.name}: the trainer of that earlier tree, interleaved" if args.baseline else "") + (
        "; textbook, malloc as ours: the textbook loop with GLIBC_TUNABLES set to train.keep_freed_memory's "
        "thresholds, interleaved (its ratio is to the plain textbook loop too)" if "textbook_kept" in base else ""),
            columns, rows)
    cats = [f"{n} rank(s)" for n in args.nproc]
    r.chart("trainer_vs_textbook_throughput.png", "samples/s (median, min-max)", "samples/s", cats,
            {k: [stats(k, n, "samples_per_s")["median"] for n in args.nproc] for k in kinds},
            low={k: [stats(k, n, "samples_per_s")["min"] for n in args.nproc] for k in kinds},
            high={k: [stats(k, n, "samples_per_s")["max"] for n in args.nproc] for k in kinds})
    r.chart("trainer_vs_textbook_first_step.png", "launch to first step (median, min-max)", "seconds", cats,
            {k: [stats(k, n, "first_step_s")["median"] for n in args.nproc] for k in kinds},
            low={k: [stats(k, n, "first_step_s")["min"] for n in args.nproc] for k in kinds},
            high={k: [stats(k, n, "first_step_s")["max"] for n in args.nproc] for k in kinds})
    r.doc["data"] = {f"{k}-{n}": v for (k, n), v in results.items()}
    r.doc["data"]["launch"] = [
        {"target": f"{'ddpkit, local' if k == 'ddpkit' else 'textbook loop under torchrun'} ({n} rank(s), cnn)",
         "first_step_s": stats(k, n, "first_step_s")} for n in args.nproc for k in kinds if k in ("textbook", "ddpkit")]
    r.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
