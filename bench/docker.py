"""The Docker figures: image size, build time (cold and warm), and launch-to-first-step of a
2-node x 2-process run of the rendered pods (`ddpkit run --docker`), next to the same job as
local processes.

  - cold build: `docker build --no-cache` from the prepared wheelhouse (offline), so every
    layer is rebuilt and nothing is downloaded;
  - warm build: the same build again, everything cached (what `make image` costs when nothing
    changed); a code-only change rebuilds the last two layers;
  - launch-to-first-step: from `ddpkit run` starting to rank 0's first optimizer step, read from
    the run's summary (`first_step_s`), for the pytorchjob and job flavors.

Needs a Docker daemon and a base image (`sudo ddpkit testbed docker up`).
Usage: python bench/docker.py [--base-image ddpkit-base:bookworm] [--tag ddpkit:bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "bench"))

from bench_common import Result, Stats  # noqa: E402

from deploy.image import build_image, image_size  # noqa: E402


def run_summary(args: list[str], cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "deploy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"`ddpkit {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():  # the pods' output (`run --docker` passes it through)
        if "ddpkit-summary " in line:
            return json.loads(line.split("ddpkit-summary ", 1)[1])
    # `run --local` prints a readable summary instead; the record is metrics.jsonl's last line
    for metrics in sorted(cwd.rglob("metrics.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True):
        last = metrics.read_text().strip().splitlines()[-1:]
        if last and json.loads(last[0]).get("summary"):
            return json.loads(last[0])
    sys.exit(f"no summary in the output of `ddpkit {' '.join(args)}` nor in a metrics.jsonl below {cwd}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-image", default="ddpkit-base:bookworm")
    parser.add_argument("--tag", default="ddpkit:bench")
    opts = parser.parse_args()
    r = Result("docker", "Docker: image build and launch to first step of the rendered pods")

    cold = build_image(opts.tag, offline=True, base_image=opts.base_image, quiet=True, no_cache=True)
    warm = build_image(opts.tag, offline=True, base_image=opts.base_image, quiet=True)
    size = image_size(opts.tag)

    job = (REPO / "examples" / "quickstart-2node.yaml").read_text().replace(
        "image: ddpkit:0.1", f"image: {opts.tag}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(job)
        for flavor in ("pytorchjob", "job"):
            (Path(tmp) / flavor).mkdir()
            s = run_summary(["run", str(path), "--docker", "--flavor", flavor], Path(tmp) / flavor)
            rows.append((f"Docker, {flavor} flavor (2 containers x 2)", s))
        s = run_summary(["run", str(path), "--local", "--nproc", "4"], Path(tmp))
        rows.append(("local processes (1 x 4), beside the Docker runs", s))

    r.text(f"Image `{opts.tag}` on `{opts.base_image}`, built offline from the wheelhouse; then "
           "`examples/quickstart-2node.yaml` (2 nodes x 2 gloo processes) run as the rendered pods "
           "(`ddpkit run --docker`) and as 4 local processes, one run each. First step: from "
           "`ddpkit run` starting to rank 0's first optimizer step (the summary's `first_step_s`).")
    r.table("image", ["figure", "value"], [
        ["image size", f"{size / 1e9:.2f} GB"],
        ["build, cold (--no-cache, offline wheelhouse)", f"{cold:.1f} s"],
        ["build, warm (all layers cached)", f"{warm:.1f} s ({cold / warm:.0f}x faster)"],
    ])
    base = rows[-1][1]["first_step_s"]
    r.table("launch to first step (n=1 each)", ["run", "first step, s", "wall, s", "vs local"],
            [[label, f"{s['first_step_s']:.1f}", f"{s['wall_s']:.1f}", f"{s['first_step_s'] / base:.2f}"]
             for label, s in rows])
    r.doc["data"] = {"launch": [{"target": label, "first_step_s": Stats([s["first_step_s"]]),
                                 "end_to_end_s": Stats([s["wall_s"]])} for label, s in rows],
                     "build_cold_s": cold, "build_warm_s": warm, "image_bytes": size}
    r.save()


if __name__ == "__main__":
    main()
