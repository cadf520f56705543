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

from deploy.image import build_image, image_size  # noqa: E402


def run_summary(args: list[str], cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "deploy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"`ddpkit {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if "ddpkit-summary " in line:
            return json.loads(line.split("ddpkit-summary ", 1)[1])
    sys.exit(f"no summary in the output of `ddpkit {' '.join(args)}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-image", default="ddpkit-base:bookworm")
    parser.add_argument("--tag", default="ddpkit:bench")
    opts = parser.parse_args()

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
            rows.append((f"docker, {flavor} (2 containers x 2)", s))
        s = run_summary(["run", str(path), "--local", "--nproc", "4"], Path(tmp))
        rows.append(("local processes (1 x 4)", s))

    print(f"image {opts.tag} on {opts.base_image}: {size / 1e9:.2f} GB")
    print(f"build, cold (--no-cache, offline wheelhouse): {cold:6.1f} s")
    print(f"build, warm (all layers cached):              {warm:6.1f} s   ({cold / warm:.0f}x faster)")
    print()
    print(f"{'2-node quickstart, 4 ranks':<36} {'first step':>10} {'wall':>8}")
    base = rows[-1][1]["first_step_s"]
    for label, s in rows:
        print(f"{label:<36} {s['first_step_s']:>8.1f} s {s['wall_s']:>6.1f} s"
              f"   ({s['first_step_s'] / base:.2f}x local)")


if __name__ == "__main__":
    main()
