"""What every `bench/` script shares: the machine, statistics, and its machine-readable result.

A script measures, prints its figures for a human, and calls `record(...)`, which writes
`<results dir>/<name>.json` (default `bench/report/results/`, or `$DDPKIT_BENCH_RESULTS`).
`bench/report.py` turns every result file into `bench/report/BENCHMARKS.md` and its PNG
charts; `bench/run_all.py` (`make bench`) runs every script and then the report.

A result file is plain data, so any script (also another helper's) can write one:

    {"name": "...", "title": "...", "command": "...", "machine": {...}, "wall_s": 12.3,
     "status": "ok" | "skipped" | "failed", "reason": "...",        # reason: why not ok
     "text": "markdown paragraph(s) shown above the tables",
     "tables": [{"caption": "...", "columns": ["...", ...], "rows": [[...], ...]}],
     "charts": [{"file": "x.png", "title": "...", "ylabel": "...", "kind": "bar" | "stacked",
                 "categories": ["...", ...], "series": {"label": [v, ...]},
                 "low": {"label": [v, ...]}, "high": {"label": [v, ...]}}],  # low/high: spread
     "notes": ["...", ...], "data": {...anything the script wants to keep...}}
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REPORT_DIR = REPO / "bench" / "report"


def results_dir() -> Path:
    d = Path(os.environ.get("DDPKIT_BENCH_RESULTS") or REPORT_DIR / "results")
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    """The facts a figure needs to be read: CPU, cores, memory, GPU, torch, load, date."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        gpu = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    torch_version = None
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None
    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch_version,
        "load_avg": load_average(),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
    }


def describe(m: dict[str, Any]) -> str:
    """One line: `2 x Intel Xeon ..., 24 GiB, no GPU, torch 2.13.0, load 3.1 2.9 2.5 (1/5/15 min)`."""
    gpu = m.get("gpu") or "no GPU"
    return (f"{m.get('cores')} x {m.get('cpu')}, {m.get('memory_gib')} GiB, {gpu}, "
            f"torch {m.get('torch')}, load {m.get('load_avg')} (1/5/15 min), {m.get('date_utc')}")


class Stats(dict):
    """median, min, max and n of repeated measurements (a dict, so it is JSON as it is)."""

    def __init__(self, values: Sequence[float]):
        vals = [float(v) for v in values if v is not None]
        super().__init__(
            median=statistics.median(vals) if vals else None,
            min=min(vals) if vals else None,
            max=max(vals) if vals else None,
            n=len(vals),
            values=vals,
        )

    def fmt(self, spec: str = ".2f", unit: str = "") -> str:
        """`1.23 s (1.10-1.40, n=5)`: median, then the spread."""
        if self["median"] is None:
            return "-"
        if self["n"] == 1:
            return f"{self['median']:{spec}}{unit} (n=1)"
        return f"{self['median']:{spec}}{unit} ({self['min']:{spec}}-{self['max']:{spec}}, n={self['n']})"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in columns]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


class Result:
    """Collects what a script measured; `save()` writes the JSON file and prints where."""

    def __init__(self, name: str, title: str, argv: Sequence[str] | None = None):
        self.started = time.time()
        argv = list(sys.argv if argv is None else argv)
        script = Path(argv[0]).name if argv else name
        self.doc: dict[str, Any] = {
            "name": name, "title": title, "status": "ok", "reason": None,
            "command": " ".join([f"python bench/{script}", *argv[1:]]),
            "machine": machine(), "text": "", "tables": [], "charts": [], "notes": [], "data": {},
        }

    def text(self, markdown: str) -> None:
        self.doc["text"] += markdown.strip() + "\n\n"

    def table(self, caption: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
              show: bool = True) -> None:
        rows = [list(r) for r in rows]
        self.doc["tables"].append({"caption": caption, "columns": list(columns), "rows": rows})
        if show:
            print(f"\n{caption}")
            print_table(columns, rows)

    def chart(self, file: str, title: str, ylabel: str, categories: Sequence[str],
              series: dict[str, Sequence[float | None]], kind: str = "bar",
              low: dict | None = None, high: dict | None = None) -> None:
        self.doc["charts"].append({"file": file, "title": title, "ylabel": ylabel, "kind": kind,
                                   "categories": list(categories),
                                   "series": {k: list(v) for k, v in series.items()},
                                   "low": low or {}, "high": high or {}})

    def note(self, line: str) -> None:
        self.doc["notes"].append(line)
        print(f"note: {line}")

    def skip(self, reason: str) -> None:
        self.doc["status"], self.doc["reason"] = "skipped", reason
        print(f"skipped: {reason}")

    def save(self) -> Path:
        self.doc["wall_s"] = round(time.time() - self.started, 1)
        self.doc["machine"]["load_avg_end"] = load_average()
        path = results_dir() / f"{self.doc['name']}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, path)
        print(f"\nresult: {path}  (machine: {describe(self.doc['machine'])})")
        return path


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
