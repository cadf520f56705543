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
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="an earlier source tree (`git archive COMMIT | tar -x -C "
                   "DIR`): its trainer is launched too, interleaved, and compared as a ratio")
    p.add_argument("--data-samples", type=int, help="train.data_samples of the cnn job (default: all 16384)")
    args = p.parse_args()
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
    shim = importtime("import trainer.launch, trainer.config, pydantic, yaml")
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
