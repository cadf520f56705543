"""Turn the result files of the bench scripts into `bench/report/BENCHMARKS.md` and PNG charts.

    python bench/report.py [--results DIR] [--out DIR]

Reads every `*.json` in the results directory (see `bench_common.py` for the format), draws
each result's charts with matplotlib next to the Markdown file, and writes one section per
result: what was measured, on which machine and under which load, the tables, the charts, and
the notes. A script that was skipped (a testbed that is down) gets a section that says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import REPORT_DIR, describe  # noqa: E402

# Sections in reading order; anything else follows alphabetically.
ORDER = ["trainer_vs_textbook", "dp_vs_ddp", "step_profile", "watchdog_overhead", "launch_time", "restart_time", "checkpoint_save",
         "launch_targets", "resize", "docker", "workdir", "slurm_testbed", "slurm_restart_in_step", "k8s_testbed", "k8s_scale", "k8s_scale_topology", "k8s_node_loss", "k8s_restart_in_pod", "goodput", "fault_corpus",
         "render_speed", "lint_speed", "gpu_path", "gpu"]


def draw(chart: dict, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats, series = chart["categories"], chart["series"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(cats) + 2), 3.6))
    n = max(1, len(series))
    x = range(len(cats))
    if chart.get("kind") == "stacked":
        bottom = [0.0] * len(cats)
        for label, vals in series.items():
            v = [0.0 if a is None else a for a in vals]
            ax.bar(list(x), v, 0.6, bottom=bottom, label=label)
            bottom = [b + a for b, a in zip(bottom, v, strict=False)]
    else:
        width = 0.8 / n
        for i, (label, vals) in enumerate(series.items()):
            pos = [j - 0.4 + width * (i + 0.5) for j in x]
            v = [float("nan") if a is None else a for a in vals]
            lo, hi = chart.get("low", {}).get(label), chart.get("high", {}).get(label)
            err = None
            if lo and hi:
                err = [[max(0.0, a - b) if a == a and b is not None else 0 for a, b in zip(v, lo, strict=False)],
                       [max(0.0, c - a) if a == a and c is not None else 0 for a, c in zip(v, hi, strict=False)]]
            ax.bar(pos, v, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(list(x))
    ax.set_xticklabels(cats, fontsize=8)
    ax.set_ylabel(chart.get("ylabel", ""))
    ax.set_title(chart.get("title", ""), fontsize=10)
    if n > 1 or chart.get("kind") == "stacked":
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out_dir / chart["file"]
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def md_table(t: dict) -> str:
    def cell(c) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    lines = [f"**{t['caption']}**", "", "| " + " | ".join(cell(c) for c in t["columns"]) + " |",
             "|" + "---|" * len(t["columns"])]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in t["rows"]]
    return "\n".join(lines)


def section(r: dict, out_dir: Path) -> str:
    parts = [f"## {r.get('title') or r['name']}", ""]
    parts.append(f"`{r.get('command', '')}` — {describe(r.get('machine', {}))}; "
                 f"load at the end {r.get('machine', {}).get('load_avg_end', '?')}; "
                 f"took {r.get('wall_s', '?')} s.")
    parts.append("")
    if r.get("status") != "ok":
        parts += [f"**{r.get('status', 'not run').upper()}**: {r.get('reason') or 'no reason given'}", ""]
    if r.get("text"):
        parts += [r["text"].strip(), ""]
    for t in r.get("tables", []):
        parts += [md_table(t), ""]
    for c in r.get("charts", []):
        try:
            draw(c, out_dir)
            parts += [f"![{c.get('title', '')}]({c['file']})", ""]
        except Exception as e:  # one bad chart must not lose the whole report
            parts += [f"(chart {c['file']} could not be drawn: {e})", ""]
    for n in r.get("notes", []):
        parts.append(f"- {n}")
    if r.get("notes"):
        parts.append("")
    return "\n".join(parts)


def launch_section(results: dict, names: list[str]) -> str:
    """One table of launch to first step on every target, from each result's `data.launch`
    entries (`{"target", "first_step_s": Stats, "end_to_end_s": Stats}`); each row names the
    section it was measured in, and its reference run measured beside it."""

    def cell(st) -> str:
        if not st or st.get("median") is None:
            return "-"
        if st.get("n", 1) == 1:
            return f"{st['median']:.1f} (n=1)"
        return f"{st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f}, n={st['n']})"

    rows = []
    for n in names:
        for e in results[n].get("data", {}).get("launch") or []:
            rows.append([e["target"], cell(e.get("first_step_s")), cell(e.get("end_to_end_s")), n])
    for n in names:
        if n in ("docker", "slurm_testbed", "k8s_testbed") and results[n].get("status") != "ok":
            rows.append([n.replace("_", " "), f"not measured: {results[n].get('reason')}", "-", n])
    for n in ("docker", "slurm_testbed", "k8s_testbed"):
        if n not in results:
            rows.append([n.replace("_", " "), "not measured: no result file", "-", "-"])
    t = {"caption": "launch to first optimizer step, seconds, median (min-max, n); each group beside "
                    "its own local reference run (compare within a group)",
         "columns": ["target", "launch -> first step, s", "end to end, s", "measured in"], "rows": rows}
    return "## Launch to first step on every target\n\n" + md_table(t) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=REPORT_DIR / "results")
    p.add_argument("--out", type=Path, default=REPORT_DIR)
    p.add_argument("--preface", type=Path, help="Markdown put at the top (e.g. the run's load)")
    args = p.parse_args(argv)
    files = sorted(args.results.glob("*.json"))
    if not files:
        print(f"no result files in {args.results}; run a bench script first", file=sys.stderr)
        return 2
    results = {}
    for f in files:
        try:
            r = json.loads(f.read_text())
            results[r.get("name") or f.stem] = r
        except (OSError, json.JSONDecodeError) as e:
            print(f"warning: {f}: {e}", file=sys.stderr)
    names = [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER)
    args.out.mkdir(parents=True, exist_ok=True)
    head = [
        "# ddpkit benchmarks",
        "",
        "Generated by `make bench` (`bench/run_all.py`, then `bench/report.py`) from the result "
        "files in `bench/report/results/`; every script also runs alone and prints its figures. "
        "Figures are medians of repeated runs with the spread (min-max, n runs); comparisons are "
        "measured in the same run, interleaved, and given as ratios. Each section names the "
        "machine and its load average when the script started and ended. Do not edit by hand.",
        "",
    ]
    if args.preface and args.preface.is_file():
        head += [args.preface.read_text().strip(), ""]
    head += ["| section | status |", "|---|---|"]
    for n in names:
        r = results[n]
        status = r.get("status", "?") + (f": {r['reason']}" if r.get("reason") else "")
        anchor = (r.get("title") or n).lower()
        anchor = "".join(ch for ch in anchor if ch.isalnum() or ch in " -").replace(" ", "-")
        head.append(f"| [{r.get('title') or n}](#{anchor}) | {status} |")
    body = [launch_section(results, names)] if any(results[n].get("data", {}).get("launch") for n in names) else []
    body += [section(results[n], args.out) for n in names]
    out = args.out / "BENCHMARKS.md"
    out.write_text("\n".join(head) + "\n\n" + "\n".join(body))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
