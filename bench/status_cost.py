"""What the progress record and `ddpkit status` cost: the trainer's per-step bookkeeping
(`Progress.tick`: the ledger, the 12-byte step file, a record rewrite once a second), a local
`ddpkit status RUN_DIR` from command start to output (a fresh interpreter, as a user runs it),
and one refresh of the `--watch` table (the reports read and the table drawn).

The per-step cost is put beside step times: the median of the 2-rank CPU `cnn` step measured
in the same run (`python -m trainer.launch`, 40 steps), and 10 ms and 100 ms steps, typical of
GPU training.

    python bench/status_cost.py [--ticks 20000]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import REPO, Result, fmt  # noqa: E402

from trainer.progress import Ledger, Progress  # noqa: E402


def tick_cost(run_dir: Path, ticks: int) -> float:
    """Seconds per `tick` over `ticks` steps (a record written once a second, as in training)."""
    progress = Progress(run_dir, Ledger(time.time(), phase="setup"), total_steps=ticks, epochs=1,
                        global_batch=128, restarts_allowed=0)
    t = time.perf_counter()
    for step in range(1, ticks + 1):
        progress.tick(step, 0)
    return (time.perf_counter() - t) / ticks


def cnn_step_s(work: Path) -> float:
    """The median step time of 2 local ranks of the built-in cnn (this machine, now)."""
    import os

    job = work / "cnn.yaml"
    job.write_text(json.dumps({"name": "cnn", "train": {"max_steps": 40, "threads": 1, "plot": False,
                                                        "eval_every_epochs": 0, "log_every_steps": 1}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPKIT_", "TORCHELASTIC_", "PET_", "SLURM_"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DDPKIT_JOB_FILE": str(job),
                "DDPKIT_NPROC_PER_NODE": "2"})
    subprocess.run([sys.executable, "-m", "trainer.launch"], cwd=work, env=env, check=True, capture_output=True)
    recs = [json.loads(line) for line in (work / "runs" / "cnn" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(128 / r["samples_per_s"] for r in recs if r.get("samples_per_s") and "loss" in r)


def status_latency(handle: str, repeats: int = 5, env: dict | None = None) -> list[float]:
    """`ddpkit status HANDLE` from command start to output, `repeats` times (a fresh interpreter)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "deploy", "status", handle], check=True, capture_output=True,
                       env=env or {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        times.append(time.perf_counter() - t)
    return times


def straggler_cost(steps: int) -> float:
    """Seconds per step of the straggler bookkeeping every rank does (trainer/stragglers.py):
    the heartbeat's phase accounting over a step's beats, and the step's record."""
    from trainer.stragglers import StepTimes
    from trainer.watchdog import Heartbeat

    hb, times = Heartbeat(), StepTimes()
    t = time.perf_counter()
    for step in range(steps):
        for phase in ("data", "forward", "backward", "optimizer"):
            hb.beat(phase, step)
        hb.rebook("allreduce", 0.0)
        hb.step_done()
        hb.beat("log")
        times.add(*hb.last_step) if hb.last_step else None
        hb.beat("vote")
        if step % 10 == 9:
            times.take()
    return (time.perf_counter() - t) / steps


def watch_refresh(run_dir: Path, repeats: int = 50) -> float:
    from rich.console import Console

    from deploy.api import Handle
    from deploy.watch import table

    handles = [Handle(str(run_dir))] * 4
    console = Console(file=io.StringIO(), width=160)
    t = time.perf_counter()
    for _ in range(repeats):
        console.print(table([(h.text, h.report()) for h in handles], time.time()))
    return (time.perf_counter() - t) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ticks", type=int, default=20000)
    ap.add_argument("--handle", action="append", default=[], metavar="HANDLE",
                    help="also time `ddpkit status HANDLE` (a cluster job: slurm://ID, k8s://...), "
                         "in this environment (PATH, KUBECONFIG)")
    args = ap.parse_args()
    res = Result("status_cost", "The progress record's cost per step, and `ddpkit status`'s latency")
    with tempfile.TemporaryDirectory(prefix="ddpkit-status-") as tmp:
        work = Path(tmp)
        per_tick = tick_cost(work / "ticks", args.ticks)
        step = cnn_step_s(work)
        latency = status_latency(str(work / "runs" / "cnn"))
        refresh = watch_refresh(work / "runs" / "cnn")
        stragglers = straggler_cost(args.ticks)
    import os

    cluster = [(h, status_latency(h, env={**os.environ, "PYTHONPATH": str(REPO)})) for h in args.handle]
    rows = [[label, fmt(seconds * 1000, ".1f"), fmt(per_tick * 1e6, ".1f"), fmt(100 * per_tick / seconds, ".3f")]
            for label, seconds in (("cnn, 2 CPU ranks (measured)", step), ("10 ms step", 0.010), ("100 ms step", 0.100))]
    res.table(f"Progress.tick per step ({args.ticks} ticks)", ["step", "step ms", "tick us", "overhead %"], rows)
    res.table("Straggler bookkeeping per step (every rank: phase accounting and the step's record)",
              ["step", "us per step", "overhead %"],
              [[label, fmt(stragglers * 1e6, ".1f"), fmt(100 * stragglers / seconds, ".3f")]
               for label, seconds in (("cnn, 2 CPU ranks (measured)", step), ("10 ms step", 0.010))])
    res.table("`ddpkit status` and `--watch`", ["what", "ms"], [
        ["`ddpkit status RUN_DIR`, command start to output (median of 5)", fmt(statistics.median(latency) * 1000, ".0f")],
        ["one `--watch` refresh of 4 local runs (reports read + table drawn)", fmt(refresh * 1000, ".1f")],
        *[[f"`ddpkit status {h}` (median of 5; min-max {min(t) * 1000:.0f}-{max(t) * 1000:.0f})",
           fmt(statistics.median(t) * 1000, ".0f")] for h, t in cluster]])
    res.text("The trainer's bookkeeping per step is the ledger's class switch, a `(time, step)` pair for "
             "the rate, one 12-byte `pwrite` of the step count and, once a second, the JSON record "
             "rewritten (tmp + rename). Cluster targets add their reads to the status latency: Slurm's "
             "`scontrol show job` and the tail of the output file; Kubernetes' get of the workload, a pod "
             "list and rank 0's log tail.")
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
