"""Loss and throughput plot of a run directory (`ddpkit plot RUN_DIR`); no torch needed."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a run directory?")
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed process
    return records


def _label(run_dir: Path, records: list[dict]) -> str:
    summary = next((r for r in reversed(records) if r.get("summary")), None)
    if not summary:
        return run_dir.name
    sps = summary.get("samples_per_s")
    return (f"{run_dir.name} ({summary.get('world_size')} ranks"
            + (f", {sps:.0f} samples/s" if sps else "") + ")")


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Loss (train and eval) and samples/s against step, one line per run, in one PNG.

    One run: `<run dir>/metrics.png` by default; several: `runs-compared.png` in the current
    directory. The train loss is rank 0's (it writes the metrics; DDP keeps the parameters equal
    on every rank), samples/s is the whole job's.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for i, run_dir in enumerate(Path(d) for d in run_dirs):
        records = read_metrics(run_dir)
        steps = [r for r in records if "loss" in r and "step" in r and not r.get("summary")]
        evals = [r for r in records if r.get("eval")]
        if not steps:
            raise ValueError(f"{run_dir}/metrics.jsonl has no step records to plot")
        color = f"C{i % 10}"
        label = _label(run_dir, records)
        ax1.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1, color=color,
                 label=f"{label}: train loss" if len(run_dirs) > 1 else "train loss (rank 0)")
        if evals:
            ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", color=color,
                     label=f"{run_dir.name}: eval loss" if len(run_dirs) > 1 else "eval loss")
        tput = [r for r in steps if r.get("samples_per_s")]
        ax2.plot([r["step"] for r in tput], [r["samples_per_s"] for r in tput], lw=1, color=color, alpha=0.8,
                 label=label)
    ax1.set_ylabel("loss")
    ax1.legend(fontsize=8)
    ax2.set_ylabel("samples/s (all ranks)")
    ax2.set_xlabel("step")
    if len(run_dirs) > 1:
        ax2.legend(fontsize=8)
    fig.suptitle(Path(run_dirs[0]).name if len(run_dirs) == 1 else f"{len(run_dirs)} runs")
    fig.tight_layout()
    if out is None:
        out = Path(run_dirs[0]) / "metrics.png" if len(run_dirs) == 1 else Path("runs-compared.png")
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `metrics.png` (loss and samples/s against step) of one run and return its path."""
    return plot_runs([run_dir], out)


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m trainer.plot RUN_DIR... [-o FILE.png]", file=sys.stderr)
        return 2
    out = None
    if "-o" in argv:
        i = argv.index("-o")
        out, argv = argv[i + 1] if i + 1 < len(argv) else None, argv[:i] + argv[i + 2:]
    try:
        print(plot_runs(argv, out))
    except (FileNotFoundError, ValueError) as e:
        print(f"ddpkit: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
