"""Checkpoints across world sizes: save and load time at 1, 2 and 4 ranks, and the cost of a
resume on another number of ranks.

One checkpoint is written by 2 local ranks (the `gpt` workload at its default size: model,
AdamW moments, scheduler, RNG states), stopped after `--steps` steps. Then, for each rank count
M in 1, 2, 4 (`--ranks`), a copy of that run resumes on M ranks (the global batch kept:
trainer/data.py `layout_for`) and trains `--steps` more steps with a checkpoint every step.
Printed per M:

- load: the `checkpoint_load` time of rank 0's goodput ledger (find the newest valid file,
  verify its sha256, `torch.load`, lay the data out for M ranks, load the state dicts);
- save: the median blocking time of its checkpoints (rank 0 serializes, hashes, writes,
  fsyncs and renames; every rank waits at the barrier after it);
- launch to first step: from the launcher's start to the end of the first step at M ranks,
  i.e. what a resize costs on a warm machine once the new group has been decided.

All runs use `python -m trainer.launch` as every target does; threads per rank 1.

    python bench/resize.py [--steps 5] [--ranks 1 2 4] [--model gpt]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, Result, fmt  # noqa: E402


def launch(job: Path, cwd: Path, nproc: int, port: int, **extra: str) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "DDPKIT_"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DDPKIT_JOB_FILE": str(job),
                "DDPKIT_NPROC_PER_NODE": str(nproc), "DDPKIT_MASTER_PORT": str(port), **extra})
    return subprocess.run([sys.executable, "-m", "trainer.launch"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def attempt_figures(run_dir: Path, after: int) -> dict[str, float | None]:
    """Load, median save and launch-to-first-step of the run's records from index `after` on."""
    recs = records(run_dir)[after:]
    saves = [r["blocking_s"] for r in recs if r.get("event") == "checkpoint"]
    summary = next(r for r in recs if r.get("summary"))
    return {"load_s": summary_ledger(run_dir).get("checkpoint_load"),
            "save_s": statistics.median(saves) if saves else None,
            "first_step_s": summary.get("first_step_s")}


def summary_ledger(run_dir: Path) -> dict[str, float]:
    """The goodput ledger's time classes of the newest attempt (its record, trainer/progress.py)."""
    newest = max((run_dir / "attempts").glob("attempt-*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(newest.read_text()).get("classes", {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--model", default="gpt")
    args = ap.parse_args()
    from deploy.run.local import free_port

    res = Result("resize", "Checkpoints across world sizes: save, load, resize cost")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train = {"model": args.model, "threads": 1, "eval_every_epochs": 0, "plot": False, "batch_size": 8,
                 "data_samples": 4096, "max_steps": 4 * args.steps, "log_every_steps": 1}
        job = tmp / "first.yaml"
        job.write_text(yaml.safe_dump({"name": "first", "train": train, "checkpoint": {"every_steps": 1}}))
        first = launch(job, tmp, 2, free_port(), DDPKIT_STOP_AT_STEP=str(args.steps))
        if first.returncode != 143:
            print(first.stdout[-3000:], first.stderr[-3000:])
            return 1
        base = attempt_figures(tmp / "runs" / "first", 0)
        rows.append(["2 (writes)", "-", fmt(base["save_s"], ".3f"), fmt(base["first_step_s"], ".2f")])
        size = max(p.stat().st_size for p in (tmp / "runs" / "first" / "checkpoints").glob("*.pt"))
        for m in args.ranks:
            name = f"on{m}"
            shutil.copytree(tmp / "runs" / "first", tmp / "runs" / name)
            (tmp / f"{name}.yaml").write_text(job.read_text().replace("name: first", f"name: {name}"))
            n = len(records(tmp / "runs" / name))
            proc = launch(tmp / f"{name}.yaml", tmp, m, free_port(), DDPKIT_STOP_AT_STEP=str(2 * args.steps))
            if proc.returncode != 143:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                return 1
            f = attempt_figures(tmp / "runs" / name, n)
            rows.append([m, fmt(f["load_s"], ".3f"), fmt(f["save_s"], ".3f"), fmt(f["first_step_s"], ".2f")])
    res.text(f"`{args.model}` workload, checkpoint file {size / 2**20:.1f} MiB, written by 2 ranks and resumed on "
             f"each rank count; global batch {2 * 8} kept.")
    res.table("Checkpoint load and save (s), launch to first step at the new size (s)",
              ["ranks", "load s", "save s (median)", "launch -> first step s"], rows)
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
