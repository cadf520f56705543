"""What a script job's `[rankR]: ` line relay (trainer/rank_lines.py) costs a worker that prints.

A worker process prints N lines of 80 bytes (flushing each, as `print(..., flush=True)` does)
to a pipe its parent drains, once straight and once through the relay, alternated, `--repeats`
times: the wall time of the worker until its last line arrived, and the ratio. A training step
prints a line or two at most; the figure is the price per line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, Result, Stats  # noqa: E402

WORKER = """
import os, sys
if os.environ["RELAY"] == "1":
    from trainer import rank_lines
    rank_lines.start(1)
line = "x" * 79
for _ in range(int(os.environ["LINES"])):
    print(line, flush=True)
"""


def one(lines: int, relay: bool) -> float:
    env = {**os.environ, "RELAY": "1" if relay else "0", "LINES": str(lines), "WORLD_SIZE": "2", "RANK": "1",
           "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, env=env, cwd=REPO)
    got = sum(chunk.count(b"\n") for chunk in iter(lambda: proc.stdout.read(1 << 16), b""))
    proc.wait()
    took = time.perf_counter() - t0
    assert got == lines, (got, lines)
    return took


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = Result("rank_lines", "A script's lines through the [rankR]: relay")
    result.text(__doc__.split("\n\n", 1)[1])
    straight, relayed = [], []
    one(1000, True)  # warm the page cache
    for _ in range(args.repeats):
        straight.append(one(args.lines, False))
        relayed.append(one(args.lines, True))
    s, r = Stats(straight), Stats(relayed)
    per_line_us = (r["median"] - s["median"]) / args.lines * 1e6
    result.table(f"{args.lines} lines of 80 bytes, each flushed (median, min-max, n): the worker's start to its last line read",
                 ["path", "wall", "lines/s", "ratio"],
                 [["straight to the pipe", s.fmt(".3f", " s"), f"{args.lines / s['median']:.0f}", "1.00x"],
                  ["through the relay", r.fmt(".3f", " s"), f"{args.lines / r['median']:.0f}",
                   f"{r['median'] / s['median']:.2f}x"]])
    result.note(f"the relay adds {per_line_us:.1f} us per line (median difference / lines)")
    result.doc["data"] = {"straight_s": s, "relayed_s": r, "per_line_us": per_line_us}
    result.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
