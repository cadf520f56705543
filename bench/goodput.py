"""Goodput under faults: a rank killed (SIGKILL) every K seconds of training, at two
checkpoint intervals (or those of --intervals).

Each run is the `cnn` workload as 2 local ranks through `python -m trainer.launch` (torchrun
with `--max-restarts`, exactly as every target starts it), `max_steps` sized so that training
alone takes about `--train-s` seconds (from a short fault-free calibration run). A killer waits
until the (re)started group logs its first step, lets it train K seconds, and SIGKILLs one worker
(rank 1 and rank 0 in turn); torchrun restarts the group, which resumes from the newest
checkpoint. Printed per checkpoint interval:

- goodput = time in useful steps / wall time, where useful = final step count x the median
  step time of the run (so restart time, lost steps and checkpoint writes are all overhead);
  over the whole wall time (launch to exit) and from the first step on (the one-time start of
  the first attempt excluded: it is not caused by faults);
- faults, steps lost per fault (steps done after the checkpoint the restart resumed from),
  seconds from a kill to the first step of the next attempt;
- the same run without faults, for comparison.

    python bench/goodput.py [--fault-every 60] [--train-s 240] [--intervals 20 100] [--warm [--async-save]]

`--warm` runs each fault run twice, interleaved: on the cold path (`DDPKIT_WARM=0`: torchrun
starts `python -m trainer.train` afresh) and on the warm path (`DDPKIT_WARM=1`: the workers are
forked from the node's template, trainer/warm.py), and adds their ratios; `--async-save` adds a
third, warm with `checkpoint.async_save: true`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Result, Stats, fmt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.progress import attempt_files, read_record  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRAIN = {"model": "cnn", "data_samples": 4096, "epochs": 1000, "batch_size": 64, "lr": 0.05,
         "momentum": 0.9, "threads": 1, "eval_every_epochs": 0, "plot": False, "log_every_steps": 1}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_pids(job_file: Path, under: int) -> dict[int, int]:
    """{rank: pid} of the live processes that compute the ranks of `job_file` below the launcher
    `under` (from /proc; the path is this run's own, so a concurrent run of this bench or of the
    tests is never hit): on the warm path the workers the template forked (named
    `ddpkit-rank<R>`, trainer/warm.py), else the `trainer.train` processes torchrun started."""
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            children.setdefault(int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(p))
        except (OSError, IndexError, ValueError):
            continue
    below, todo = [], [under]
    while todo:
        below.append(todo.pop())
        todo += children.get(below[-1], [])
    found: dict[int, int] = {}
    forked: dict[int, int] = {}
    for pid in below:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm.startswith("ddpkit-rank") and comm[11:].isdigit():
                forked[int(comm[11:])] = pid
                continue
            if b"trainer.train" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"DDPKIT_JOB_FILE") == str(job_file).encode() and b"RANK" in env and b"DDPKIT_WARM_SOCKET" not in env:
            found[int(env[b"RANK"])] = int(pid)
    return forked or found


def read_records(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def ledger_of(run_dir: Path) -> dict | None:
    """The run as the trainer's goodput ledger booked it: the newest attempt's `run` totals."""
    files = attempt_files(run_dir)
    record = read_record(files[-1]) if files else None
    return record["run"] if record else None


def run_once(work: Path, name: str, every: int, max_steps: int, nproc: int, fault_every: float | None,
             tree: Path = REPO, warm: bool | None = None, async_save: bool = False) -> dict:
    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "train": {**TRAIN, "max_steps": max_steps},
                                   "checkpoint": {"every_steps": every, "keep": 2, "async_save": async_save}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "DDPKIT_"))}
    env.update({"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "DDPKIT_JOB_FILE": str(job),
                "DDPKIT_NPROC_PER_NODE": str(nproc), "DDPKIT_MASTER_PORT": str(free_port()),
                "DDPKIT_MAX_RESTARTS": "1000"})
    if warm is not None:  # trainer/warm.py: DDPKIT_WARM=1 forks the workers from a template
        env["DDPKIT_WARM"] = "1" if warm else "0"
    run_dir = work / "runs" / name
    kills: list[float] = []
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # First-step times per attempt, seen from outside: the number of step records grows.
    first_steps: list[float] = []
    done = threading.Event()

    def killer() -> None:
        seen_resumes, attempt_started = -1, None
        while not done.is_set():
            recs = read_records(run_dir)
            resumes = sum(1 for r in recs if r.get("event") == "resumed")
            if recs and any("loss" in r for r in recs) and resumes > seen_resumes:
                # the newest attempt has logged a step after its resume record (or the first one)
                last_resume = max((i for i, r in enumerate(recs) if r.get("event") == "resumed"), default=-1)
                if any("loss" in r for r in recs[last_resume + 1:]):
                    seen_resumes, attempt_started = resumes, time.monotonic()
                    first_steps.append(attempt_started - t0)
            if (fault_every and attempt_started is not None and time.monotonic() - attempt_started >= fault_every
                    and not any(r.get("summary") for r in recs)):
                pids = worker_pids(job, proc.pid)
                rank = len(kills) % 2 if len(kills) % 2 in pids else next(iter(pids), None)
                if rank is not None:
                    os.kill(pids[rank], signal.SIGKILL)
                    kills.append(time.monotonic() - t0)
                    attempt_started = None
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    wall = time.monotonic() - t0
    done.set()
    thread.join()
    recs = read_records(run_dir)
    steps = [r for r in recs if "loss" in r and r.get("samples_per_s")]
    summary = next((r for r in reversed(recs) if r.get("summary")), {})
    global_batch = summary.get("global_batch") or TRAIN["batch_size"] * nproc
    median_dt = statistics.median(global_batch / r["samples_per_s"] for r in steps)
    lost, segment_max, prev = [], 0, None
    for r in recs:
        if "loss" in r:
            segment_max = max(segment_max, r["step"])
        elif r.get("event") == "resumed":
            if prev is not None or segment_max:
                lost.append(segment_max - r["step"])
            segment_max, prev = 0, r["step"]
    final = summary.get("steps", 0)
    useful = final * median_dt
    # the same from the step times themselves: each step number's last (kept) execution
    kept = {r["step"]: global_batch / r["samples_per_s"] for r in steps}
    useful_sum = sum(kept.values())
    first = first_steps[0] if first_steps else 0.0
    restart_s = [min((f for f in first_steps if f > k), default=wall) - k for k in kills]
    if proc.returncode != 0:
        print(out[-3000:])
    ledger = ledger_of(run_dir)
    return {"ledger_goodput": ledger["goodput"] if ledger else None,
            "ledger_wall_s": ledger["wall_s"] if ledger else None,
            "ledger_classes": ledger["classes"] if ledger else None,
            "rc": proc.returncode, "status": summary.get("status"), "steps": final, "wall_s": wall,
            "median_step_s": median_dt, "faults": len(kills), "lost": lost,
            "goodput": useful / wall, "goodput_step_sum": useful_sum / wall, "goodput_after_start": useful / max(1e-9, wall - first + median_dt),
            "goodput_after_start_step_sum": useful_sum / max(1e-9, wall - first + median_dt),
            "first_step_s": first, "restart_s": restart_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds of training between kills")
    ap.add_argument("--train-s", type=float, default=240.0, help="fault-free training time to aim for")
    ap.add_argument("--intervals", type=int, nargs="+", default=[20, 100], help="checkpoint intervals (steps)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="run every fault run on the cold path (DDPKIT_WARM=0) "
                    "and on the warm path (DDPKIT_WARM=1, trainer/warm.py), interleaved, with warm / cold "
                    "ratios (the fault-free runs are skipped)")
    ap.add_argument("--async-save", action="store_true", help="with --warm: a third run, warm with "
                    "`checkpoint.async_save` (the copy to host memory in the step, the write beside training)")
    ap.add_argument("--baseline", type=Path, help="an earlier source tree (e.g. `git archive COMMIT | tar -x "
                    "-C DIR`): its trainer runs the same fault runs, interleaved with this one's, and the "
                    "table gets this / baseline ratios (the fault-free runs are skipped)")
    args = ap.parse_args()
    res = Result("goodput", "Goodput with a rank killed every K seconds")
    with tempfile.TemporaryDirectory(prefix="ddpkit-goodput-") as tmp:
        work = Path(tmp)
        calib = run_once(work, "calib", 1000, 60, args.nproc, None)
        max_steps = max(50, int(args.train_s / calib["median_step_s"]))
        print(f"calibration: {calib['median_step_s'] * 1000:.0f} ms/step -> max_steps {max_steps}", flush=True)
        rows, data, ratios = [], {}, []
        trees = [("this", REPO, None, False)] + ([("baseline", args.baseline.resolve(), None, False)]
                                                  if args.baseline else [])
        if args.warm:
            trees = [("cold", REPO, False, False), ("warm", REPO, True, False)]
            trees += [("warm+async", REPO, True, True)] if args.async_save else []
        runs = [("faults", args.fault_every)] + ([] if args.baseline or args.warm else [("none", None)])
        for every, (label, fault), (tag, tree, warm, async_save) in itertools.product(args.intervals, runs, trees):
            r = run_once(work, f"c{every}-{label}-{tag.replace('+', '-')}", every, max_steps, args.nproc, fault,
                         tree, warm, async_save)
            data[f"{tag}-every{every}-{label}"] = r
            lost = r["lost"]
            rows.append([every if tag == "this" else f"{every} ({tag})",
                         label if fault is None else f"every {fault:.0f} s", r["status"], r["steps"],
                         r["faults"], fmt(r["wall_s"], ".0f"), fmt(r["median_step_s"] * 1000, ".0f"),
                         fmt(statistics.mean(lost), ".1f") if lost else "-", max(lost) if lost else "-",
                         fmt(statistics.median(r["restart_s"]), ".1f") if r["restart_s"] else "-",
                         fmt(r["goodput"], ".3f"), fmt(r["goodput_after_start"], ".3f"),
                         fmt(r["goodput_step_sum"], ".3f"), fmt(r["goodput_after_start_step_sum"], ".3f"),
                         fmt(r["ledger_goodput"], ".3f"),
                         fmt(r["ledger_goodput"] / r["goodput_step_sum"] if r["ledger_goodput"] else None, ".3f")])
            print(rows[-1], flush=True)
        for every in args.intervals if args.baseline else []:
            this, base = data[f"this-every{every}-faults"], data[f"baseline-every{every}-faults"]
            restart = (statistics.median(this["restart_s"]) / statistics.median(base["restart_s"])
                       if this["restart_s"] and base["restart_s"] else None)
            ratios.append([every, fmt(this["goodput"] / base["goodput"], ".2f"),
                           fmt(this["goodput_after_start"] / base["goodput_after_start"], ".2f"),
                           fmt(restart, ".2f")])
    res.table(f"cnn, {args.nproc} ranks (gloo, 1 thread each), {max_steps} steps; goodput = steps x median "
              "step time / wall time", ["ckpt every", "kills", "status", "steps", "faults", "wall s", "ms/step",
                                        "lost/fault", "max lost", "kill->step s", "goodput", "after start",
                                        "step sum", "step sum after start", "ledger", "ledger/step sum"], rows)
    for every in args.intervals if args.warm else []:
        this, base = data[f"warm-every{every}-faults"], data[f"cold-every{every}-faults"]
        ratios.append([every, fmt(this["goodput_after_start"], ".3f"), fmt(base["goodput_after_start"], ".3f"),
                       fmt(this["goodput_after_start_step_sum"], ".3f"), fmt(base["goodput_after_start_step_sum"], ".3f"),
                       fmt(this["goodput"] / base["goodput"], ".2f"),
                       fmt(this["goodput_after_start"] / base["goodput_after_start"], ".2f"),
                       Stats(this["restart_s"]).fmt(".2f"), Stats(base["restart_s"]).fmt(".2f")])
    if args.baseline:
        res.table(f"this tree / baseline ({args.baseline}), same run, interleaved", ["ckpt every", "goodput",
                  "after start", "kill->step"], ratios)
    if args.warm:
        res.table("warm restarts (a template forks the workers) vs cold (fresh `python -m trainer.train`), "
                  "same run, interleaved", ["ckpt every", "after start, warm", "after start, cold",
                                            "step sum after start, warm", "step sum after start, cold",
                                            "goodput warm / cold", "after start warm / cold",
                                            "kill->step s, warm", "kill->step s, cold"], ratios)
    res.doc["data"] = {"max_steps": max_steps, "calibration": calib, "runs": data, "args": vars(args)}
    res.text(f"A worker is SIGKILLed after every {args.fault_every:.0f} s of training; torchrun restarts "
             "the group, which resumes from the newest checkpoint. `after start` leaves out the first "
             "attempt's one-time start (imports, data, process group) that a fault-free run pays too. "
             "`step sum` counts each kept step at its own logged time instead of the median (the "
             "two differ when steps vary, as on a loaded machine); `ledger` is the same run's "
             "goodput as the trainer's own ledger books it (productive steps / launch to the last "
             "record: RUN_DIR/attempts/), and `ledger/step sum` their ratio (the ledger's wall "
             "leaves out the interpreter start before the launch mark and the exit after the last "
             "record).")
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
