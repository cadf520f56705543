"""A rank killed inside a running Slurm job on the 2-node testbed: kill -> the next attempt's
first step, with no requeue (the job keeps its allocation), side by side in one run:

- `in the step, warm`: torchrun mode, `restarts: N` is torchrun's `--max-restarts N`; both
  nodes' agents restart their workers inside the running job step, forked from the node's
  template (trainer/warm.py);
- `in the step, cold`: the same with `train.warm_restarts: false` (every worker imports torch
  again);
- `new step`: elastic `nodes: 1:2` and a spare (docs/slurm.md "Restarts inside the allocation": Slurm
  then allocates both nodes, and the step runs on both): torchrun restarts nothing, the batch
  shell probes the nodes and starts a new job step on the healthy ones, so every node's
  launcher and its template start afresh.

The job is examples/quickstart-2node.yaml (2 nodes x 2 gloo ranks) with a long `max_steps`; once
the attempt has trained 30 steps, `kill -9` of rank 3's process on node 2 (the testbed's nodes
share this machine's process table; a forked worker is named `ddpkit-rank3`, a cold one runs
trainer.train with RANK=3), timed to the moment rank 0 records the new attempt's first step
(RUN_DIR/attempts/attempt-N.step, polled every 50 ms).

Needs root and the Slurm testbed up (sudo ddpkit testbed slurm up).
Usage: sudo python bench/slurm_restart_in_step.py [--kills 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_common import Result, fmt  # noqa: E402
from deploy.testbed import slurm as testbed  # noqa: E402
from trainer.attempts import ATTEMPTS_DIR, LAUNCH_DIR, read_records  # noqa: E402

JOB = REPO / "examples" / "quickstart-2node.yaml"
PHASES = ("torchrun ended", "new launcher", "first step")
SETTINGS = {"in the step, warm": {"warm_restarts": True},
            "in the step, cold": {"warm_restarts": False},
            "new step": {"warm_restarts": True, "nodes": "1:2", "spare_nodes": 1}}


def rank_pid(rank: int) -> int | None:
    """The process of global rank `rank` (a worker torchrun started, or one the template forked)."""
    for pid in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm == f"ddpkit-rank{rank}":
                return int(pid)
            if b"trainer.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in env and not any(v.startswith(b"DDPKIT_WARM_SOCKET=") for v in env):
                    return int(pid)
        except OSError:
            continue
    return None


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def until(what: str, predicate, timeout: float = 300, every: float = 0.05):
    t0 = time.monotonic()
    while not (found := predicate()):
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"no {what} after {timeout:.0f} s")
        time.sleep(every)
    return found


def submit(env: dict, work: Path, name: str, setting: dict, kills: int) -> str:
    job = yaml.safe_load(JOB.read_text())
    job.update(name=name, restarts=kills + 1)
    if "nodes" in setting:
        job["nodes"] = setting["nodes"]
    job["slurm"] = {**job.get("slurm", {}), "venv": sys.prefix, "requeue": False,
                    "spare_nodes": setting.get("spare_nodes", 0)}
    job["train"].update(max_steps=100000, epochs=1000, plot=False, warm_restarts=setting["warm_restarts"])
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "deploy", "submit", "slurm", str(path)], cwd=work, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip())
    return proc.stdout.strip()


def kill_and_time(run_dir: Path, attempt: int) -> tuple[float, float, float]:
    """Kill rank 3 once attempt `attempt - 1` trained 30 steps: the seconds to attempt
    `attempt`'s first step, the kill's wall-clock time and the first step's."""
    until(f"attempt {attempt - 1} past 30 steps", lambda: steps_logged(run_dir) >= 30 * attempt, every=0.5)
    pid = until("rank 3's process", lambda: rank_pid(3), timeout=60)
    killed, killed_at = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    step_file = run_dir / "attempts" / f"attempt-{attempt}.step"
    until(f"attempt {attempt}'s first step", lambda: step_file.exists() and step_file.stat().st_size > 0)
    return time.monotonic() - killed, killed_at, time.time()


def last_launch_marks(run_dir: Path, wait_s: float = 20) -> dict[str, float]:
    """The launch marks of the run's summary (written when the cancelled attempt stopped)."""
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + wait_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        summary = next((json.loads(x) for x in reversed(lines) if '"summary"' in x), None)
        if summary and summary.get("launch_marks"):
            return summary["launch_marks"]
        time.sleep(0.5)
    return {}


def where_it_went(run_dir: Path, kills: list[tuple[float, float]]) -> list[dict]:
    """Per kill (its wall time, the next first step's), from the nodes' launch records (written
    when each launcher ends): the old launchers' torchrun noticing and ending (kill -> the last
    one ended), the shell's part (-> the first new launcher started: the step's end, the probes,
    the new `srun`), and the new attempt's start (-> its first step: torchrun, the rendezvous,
    the workers, the checkpoint). In-step restarts keep their launchers: the first two are empty."""
    launches = read_records(run_dir / ATTEMPTS_DIR / LAUNCH_DIR)
    out = []
    for killed_at, first_step in kills:
        old = [x["ended"] for x in launches if x["started"] < killed_at <= x.get("ended", 0)]
        new = [x["started"] for x in launches if killed_at < x["started"] < first_step]
        if not (old and new):
            out.append({})
            continue
        out.append({"torchrun ended": max(old) - killed_at, "new launcher": min(new) - max(old),
                    "first step": first_step - min(new)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="SETTING",
                        help=f"which restarts to time (default all: {', '.join(map(repr, SETTINGS))})")
    args = parser.parse_args()
    if not testbed.status(quiet=True):
        raise SystemExit("the Slurm testbed is down: sudo ddpkit testbed slurm up")
    env = {**testbed.client_env(), "PYTHONPATH": str(REPO)}
    res = Result("slurm_restart_in_step", "Slurm testbed: a rank killed inside a running job, no requeue")
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="ddpkit-instep-") as tmp:
        os.chmod(tmp, 0o755)
        for label, setting in ((k, SETTINGS[k]) for k in args.settings):
            name = "bench-instep-" + label.replace(",", "").replace(" ", "-")
            work = Path(tmp) / name
            work.mkdir()
            handle, times, kills = submit(env, work, name, setting, args.kills), [], []
            try:
                for kill in range(1, args.kills + 1):
                    took, killed_at, first_step = kill_and_time(work / "runs" / name, kill)
                    times.append(took)
                    kills.append((killed_at, first_step))
            except RuntimeError as err:  # the figures so far stand; the failure is reported
                res.note(f"{label}: {err}")
            finally:
                subprocess.run([sys.executable, "-m", "deploy", "cancel", handle], env=env, capture_output=True)
            if times:
                phases = where_it_went(work / "runs" / name, kills)
                marks = last_launch_marks(work / "runs" / name)
                if marks:  # the last attempt's own marks, seconds after its node's launcher started
                    res.note(f"{label}: the last attempt, s after its launcher started: "
                             + ", ".join(f"{k} {v:.2f}" for k, v in marks.items()))
                print(json.dumps({"setting": label, "kill_to_first_step_s": times, "phases_s": phases}), flush=True)
                runs.append({"setting": label, "kill_to_first_step_s": times, "phases_s": phases})
                parts = {k: statistics.median(p[k] for p in phases if p) for k in PHASES if any(phases)}
                rows.append([label, fmt(statistics.median(times)), f"{min(times):.2f}-{max(times):.2f}", len(times),
                             *(fmt(parts[k]) if parts else "-" for k in PHASES)])
    res.text("`kill -9` of rank 3 (node 2) while quickstart-2node trains on the testbed (2 nodes x 2 "
             "ranks); the job keeps its allocation (no requeue); timed to the new attempt's first step.")
    res.table("kill -> the next attempt's first step inside a running Slurm job",
              ["restart", "kill -> first step s (median)", "range", "kills",
               *(f"{k} s" for k in PHASES)], rows)
    res.text("A new step's time by part (medians; from the nodes' launch records): kill -> the old "
             "step's last torchrun ended; -> the first new launcher started (the step's end, the batch "
             "shell's probes, the new srun); -> the first step (torchrun, rendezvous, workers, checkpoint).")
    res.doc["data"]["runs"] = runs
    res.save()


if __name__ == "__main__":
    main()
