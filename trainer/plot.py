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


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `metrics.png` (loss and samples/s against step) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r and "step" in r and not r.get("summary")]
    evals = [r for r in records if r.get("eval")]
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step records to plot")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1, label="train loss (rank 0)")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax1.set_ylabel("loss")
    ax1.legend()
    tput = [r for r in steps if r.get("samples_per_s")]
    ax2.plot([r["step"] for r in tput], [r["samples_per_s"] for r in tput], lw=1)
    ax2.set_ylabel("samples/s (all ranks)")
    ax2.set_xlabel("step")
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainer.plot RUN_DIR", file=sys.stderr)
        return 2
    try:
        print(plot_run(argv[0]))
    except (FileNotFoundError, ValueError) as e:
        print(f"ddpkit: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
