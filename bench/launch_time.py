"""Where launch to first step goes: our trainer vs the textbook loop, phase by phase.

Both start from a launcher process at time 0 (`DDPKIT_LAUNCH_T0`): ours is
`python -m trainer.launch` (the node shim every target runs, which reads the job file and
starts torchrun with c10d rendezvous), the textbook loop is `torchrun` (static rendezvous)
running `bench/textbook_ddp.py`. Each records timestamps (ours: the summary's `launch_marks`;
the textbook's: its JSON report), interleaved `--repeats` times at `--nproc` ranks, and the
medians are printed side by side. (Tried and dropped: importing `torch._dynamo`, which the first
optimizer imports, in a background thread from `import torch` on; on this 2-core machine it
slowed the data set generation it was meant to overlap by more than it saved.) Then `python -X importtime` of what our worker imports
besides torch, and of the node shim, shows the import costs that are ours alone.

    python bench/launch_time.py [--repeats 3] [--nproc 2]

With `--kills N`, it measures a restart instead (result `restart_time`): kill -> the next
attempt's first step, torchrun restarting the group on the cold path (`python -m trainer.train`
afresh) and on the warm path (a fork of the node's pre-imported template, trainer/warm.py),
N kills per run, the two paths interleaved, with each launch mark after the kill:

    python bench/launch_time.py --kills 6 [--rounds 1] [--train-s 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import Result, Stats, fmt, ratio  # noqa: E402
from trainer_vs_textbook import REPO, base_env, free_port  # noqa: E402

OURS = ["torchrun started", "worker started", "job read", "torch imported", "process group",
        "workload built", "optimizer+loader", "DDP", "first step"]
TEXTBOOK = ["worker started", "torch imported", "process group", "data, model, DDP, optimizer", "first step"]


def run_ours(work: Path, nproc: int, i: int, steps: int, tree: Path = REPO, samples: int | None = None) -> dict:
    import yaml

    name = f"lt-{nproc}-{i}-{abs(hash(str(tree))) % 1000}"
    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "train": {
        "max_steps": steps, "threads": 1, "eval_every_epochs": 0, "plot": False, "data_samples": samples}}))
    env = {**base_env(1), "PYTHONPATH": str(tree), "DDPKIT_JOB_FILE": str(job), "DDPKIT_NPROC_PER_NODE": str(nproc),
           "DDPKIT_MASTER_PORT": str(free_port()), "DDPKIT_LAUNCH_T0": repr(time.time())}
    subprocess.run([sys.executable, "-m", "trainer.launch"], cwd=work, env=env, check=True, capture_output=True)
    s = json.loads((work / "runs" / name / "metrics.jsonl").read_text().splitlines()[-1])
    return s["launch_marks"]


def run_textbook(work: Path, nproc: int, steps: int) -> dict:
    out = work / f"textbook-{nproc}.json"
    env = {**base_env(1), "DDPKIT_LAUNCH_T0": repr(time.time())}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--master-port", str(free_port()), str(REPO / "bench" / "textbook_ddp.py"),
                    str(out), str(steps), "1"], cwd=work, env=env, check=True, capture_output=True)
    return json.loads(out.read_text())["launch_marks"]


def importtime(code: str) -> list[tuple[str, float]]:
    """(top-level package, cumulative seconds) of `python -X importtime -c code`, biggest first."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=REPO, capture_output=True,
                          text=True, env={**base_env(1)})
    tops: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if not cumulative.strip().isdigit():
            continue  # the header line
        if name.startswith(" ") and not name.startswith("  "):  # depth 1: imported by the code itself
            tops[name.strip()] = int(cumulative) / 1e6
    return sorted(tops.items(), key=lambda kv: -kv[1])


# -- kill -> next first step: the restart, cold vs warm ---------------------------------------
FIRST_STEP_LINE = re.compile(r"first step ([\d.]+)s after launch \((.*)\)")
RESTART_MARKS = ["worker started", "forked", "job read", "torch imported", "process group", "workload built",
                 "optimizer+loader", "DDP", "first step"]


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of the process that computes rank `rank` below process `launcher`: a forked
    worker of the warm path (named `ddpkit-rank<R>`, trainer/warm.py), else the `trainer.train`
    process torchrun started (its environment says the rank)."""
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(p))
    todo, found = [launcher], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    for pid in found:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"ddpkit-rank{rank}":
                return pid
    for pid in found:
        with contextlib.suppress(OSError):
            if b"trainer.train" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env and not any(e.startswith(b"DDPKIT_WARM_SOCKET=") for e in env):
                return pid
    return None


def restart_run(work: Path, nproc: int, kills: int, warm: bool, train_s: float, tree: Path = REPO) -> dict:
    """One launch with `kills` restarts: after each attempt's first step and `train_s` seconds of
    training, SIGKILL the worker process of rank 1, then rank 0, in turn; the seconds from each
    kill to the next attempt's first step (rank 0's `first step ... after launch (marks)` line),
    and where they went (the marks, seconds after the kill)."""
    import yaml

    name = f"rs-{'warm' if warm else 'cold'}-{nproc}"
    work.mkdir(parents=True, exist_ok=True)
    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"name": name, "checkpoint": {"every_steps": 20, "keep": 2}, "train": {
        "max_steps": 100000, "epochs": 1000, "threads": 1, "eval_every_epochs": 0, "plot": False,
        "data_samples": 4096, "lr": 0.05, "momentum": 0.9}}))
    t0 = time.time()
    env = {**base_env(1), "PYTHONPATH": str(tree), "DDPKIT_JOB_FILE": str(job), "DDPKIT_NPROC_PER_NODE": str(nproc),
           "DDPKIT_MASTER_PORT": str(free_port()), "DDPKIT_LAUNCH_T0": repr(t0),
           "DDPKIT_MAX_RESTARTS": str(kills), "DDPKIT_WARM": "1" if warm else "0"}
    proc = subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    firsts: list[tuple[float, dict[str, float]]] = []  # (first step, marks), absolute times
    tail: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            tail.append(line)
            found = FIRST_STEP_LINE.search(line)
            if found:
                marks = {k.strip(): t0 + float(v.rstrip("s")) for k, v in
                         (part.rsplit(" ", 1) for part in found.group(2).split(", "))}
                firsts.append((t0 + float(found.group(1)), marks))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed: list[float] = []
    deadline = time.monotonic() + 120 + kills * (train_s + 60)
    while len(killed) < kills and proc.poll() is None and time.monotonic() < deadline:
        if len(firsts) > len(killed) and time.time() - firsts[-1][0] >= train_s:
            pid = worker_pid(proc.pid, 1 - len(killed) % 2 if nproc > 1 else 0)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(time.time())
        time.sleep(0.05)
    while len(firsts) <= len(killed) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    reader.join(timeout=10)
    restarts = []
    for kill, (first, marks) in zip(killed, firsts[1:], strict=False):
        restarts.append({"kill_to_first_step_s": first - kill,
                         "marks": {k: round(v - kill, 3) for k, v in marks.items() if v >= kill - 1}})
    if len(restarts) < kills:
        print("".join(tail[-40:]), file=sys.stderr)
    return {"warm": warm, "restarts": restarts, "first_start_s": firsts[0][0] - t0 if firsts else None,
            "rc": proc.returncode}


def restart_main(args: argparse.Namespace) -> int:
    """`--kills N`: kill -> next first step, the cold path and the warm path side by side."""
    r = Result("restart_time", "Kill to the next first step: cold vs warm restarts")
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="ddpkit-restart-") as tmp:
        for i in range(args.rounds):
            for path in ("cold", "warm"):
                run = restart_run(Path(tmp) / f"{path}-{i}", args.nproc, args.kills, path == "warm", args.train_s)
                runs[path].append(run)
                print(f"  round {i + 1}/{args.rounds} {path}: kill -> first step "
                      + ", ".join(f"{x['kill_to_first_step_s']:.2f}" for x in run["restarts"]) + " s", flush=True)
    every = {p: [x for run in runs[p] for x in run["restarts"]] for p in runs}
    k2f = {p: Stats([x["kill_to_first_step_s"] for x in every[p]]) for p in runs}
    r.text(f"{args.nproc} local ranks (`python -m trainer.launch`, torchrun `--max-restarts`), the `cnn` "
           f"workload (data_samples 4096, 1 thread per rank, checkpoint every 20 steps): after each "
           f"attempt's first step and {args.train_s:.0f} s of training, the worker process of rank 1, "
           "then rank 0, is SIGKILLed; seconds from the kill to the next attempt's first step (rank 0's "
           f"launch marks). {args.rounds} round(s) of {args.kills} kills per path, the paths interleaved. "
           "Cold: torchrun starts `python -m trainer.train` afresh (`DDPKIT_WARM=0`); warm: a client "
           "asks the node's template process, which imported torch and the trainer once, to fork the "
           "worker (trainer/warm.py).")
    r.table("kill -> next first step, seconds, median (min-max, n)", ["path", "kill -> first step"],
            [[p, k2f[p].fmt(".2f")] for p in runs] + [["warm / cold", fmt(ratio(k2f["warm"]["median"],
                                                                                  k2f["cold"]["median"]), ".2f")]])
    rows = []
    for mark in RESTART_MARKS:
        cells = [Stats([x["marks"][mark] for x in every[p] if mark in x["marks"]]) for p in runs]
        if any(c["median"] is not None for c in cells):
            rows.append([mark, *(c.fmt(".2f") for c in cells)])
    r.table("where a restart goes: each mark, seconds after the kill, median (min-max, n)",
            ["mark", "cold", "warm"], rows)
    r.doc["data"] = {"runs": runs, "args": {k: str(v) for k, v in vars(args).items()}}
    r.save()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="an earlier source tree (`git archive COMMIT | tar -x -C "
                   "DIR`): its trainer is launched too, interleaved, and compared as a ratio")
    p.add_argument("--data-samples", type=int, help="train.data_samples of the cnn job (default: all 16384)")
    p.add_argument("--kills", type=int, help="instead: kill -> next first step, cold vs warm restarts, "
                   "KILLS kills per run (restart_time)")
    p.add_argument("--rounds", type=int, default=1, help="with --kills: runs per path, interleaved")
    p.add_argument("--train-s", type=float, default=3.0, help="with --kills: seconds of training between kills")
    args = p.parse_args()
    if args.kills:
        return restart_main(args)
    r = Result("launch_time", "Where launch to first step goes (ours vs the textbook loop)")
    ours, textbook, baseline = [], [], []
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as tmp:
        for i in range(args.repeats):
            textbook.append(run_textbook(Path(tmp), args.nproc, args.steps))
            ours.append(run_ours(Path(tmp), args.nproc, i, args.steps, samples=args.data_samples))
            if args.baseline:
                baseline.append(run_ours(Path(tmp), args.nproc, i, args.steps, args.baseline.resolve(),
                                         samples=args.data_samples))
            print(f"  repeat {i + 1}/{args.repeats}: first step textbook {textbook[-1]['first step']:.2f} s, "
                  f"ours {ours[-1]['first step']:.2f} s"
                  + (f", baseline {baseline[-1]['first step']:.2f} s" if baseline else ""), flush=True)

    def at(runs: list[dict], mark: str) -> Stats:
        return Stats([m[mark] for m in runs if mark in m])

    r.text(f"{args.nproc} rank(s), the `cnn` workload, 1 thread per rank, {args.repeats} interleaved "
           "repeats. Each row: seconds from starting the launcher process to that point (rank 0), "
           "median (min-max); the step column is the time since the previous row.")
    rows, prev = [], 0.0
    for mark in OURS:
        st = at(ours, mark)
        if st["median"] is None:
            continue
        rows.append([f"ours: {mark}", st.fmt(".2f"), f"{st['median'] - prev:+.2f}"])
        prev = st["median"]
    prev = 0.0
    for mark in TEXTBOOK:
        st = at(textbook, mark)
        rows.append([f"textbook: {mark}", st.fmt(".2f"), f"{st['median'] - prev:+.2f}"])
        prev = st["median"]
    r.table("launch timeline, seconds since the launcher started", ["mark", "at, s", "step, s"], rows)
    fo, ft = at(ours, "first step"), at(textbook, "first step")
    r.note(f"first step: ours {fo.fmt('.2f', ' s')}, textbook {ft.fmt('.2f', ' s')}, "
           f"ours / textbook {fmt(ratio(fo['median'], ft['median']), '.2f')}, "
           f"difference {fmt((fo['median'] or 0) - (ft['median'] or 0), '+.2f')} s")
    common = [("interpreter up (worker started)", "worker started", "worker started"),
              ("torch imported", "torch imported", "torch imported"),
              ("process group joined", "process group", "process group"),
              ("first step", "first step", "first step")]
    if baseline:
        rows = []
        for mark in OURS:
            a, b = at(ours, mark), at(baseline, mark)
            if a["median"] is not None and b["median"] is not None:
                rows.append([mark, a.fmt(".2f"), b.fmt(".2f"), fmt(ratio(a["median"], b["median"]), ".2f")])
        r.table(f"this tree vs baseline {args.baseline} (same run, interleaved), seconds since launch",
                ["mark", "this", "baseline", "this / baseline"], rows)
    r.chart("launch_time.png", f"launch timeline, {args.nproc} rank(s) (median)", "seconds since launch",
            [c[0] for c in common], {"textbook": [at(textbook, c[2])["median"] for c in common],
                                     "ddpkit": [at(ours, c[1])["median"] for c in common]})
    shim = importtime("import trainer.launch.node, trainer.config, pydantic, yaml")
    worker = importtime("import torch; import trainer.train, trainer.config, trainer.dist, trainer.models, "
                        "trainer.data, trainer.checkpoint, tqdm, yaml, pydantic")
    r.table("python -X importtime: the node shim's imports (cumulative s, top 5)", ["module", "s"],
            [[m, f"{t:.3f}"] for m, t in shim[:5]])
    r.table("python -X importtime: our worker's imports (cumulative s, top 8; the textbook loop imports torch only)",
            ["module", "s"], [[m, f"{t:.3f}"] for m, t in worker[:8]])
    r.doc["data"] = {"ours": ours, "textbook": textbook, "baseline": baseline, "importtime_shim": shim, "importtime_worker": worker}
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
