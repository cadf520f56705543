"""The Kubernetes testbed's figures: cold build time and disk size, warm bring-up, and per
flavor submit -> Running and submit -> Succeeded, next to `ddpkit run --docker` of the same job.

  - cold build: the `.seconds` build.sh wrote for each component (a build from an empty cache;
    the Go module downloads included);
  - disk: the binaries (cache minus Go's build cache), the Go build cache, containerd's image
    store, and the running cluster's state dir;
  - warm bring-up: `ddpkit testbed k8s up` with the binaries and images cached. Measured only
    when the cluster is down at the start (it is brought down again at the end); a cluster
    someone else brought up is never taken down;
  - per flavor, quickstart-2node shrunk to the node (0.7 CPU, 2 GiB per pod), median of
    --runs: `ddpkit submit k8s` to `ddpkit status` RUNNING, and to SUCCEEDED; then
    `ddpkit run --docker` of the same job file (the rendered pods as containers): start to
    first step (`first_step_s`) and start to exit.

Needs root, the binaries and the Docker testbed with the image (`ddpkit image build --offline
--base-image ddpkit-base:bookworm --tag ddpkit:test`).
Usage: python bench/k8s_testbed.py [--runs 3] [--image ddpkit:test] [--flavors pytorchjob,job]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deploy.testbed import k8s as testbed  # noqa: E402


def du(path: Path, *exclude: str) -> str:
    if not path.exists():
        return "-"
    args = ["du", "-sh", *[f"--exclude={e}" for e in exclude], str(path)]
    return subprocess.run(args, capture_output=True, text=True).stdout.split("\t")[0] or "-"


def ddpkit(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def job_file(tmp: Path, name: str, image: str, flavor: str) -> Path:
    job = yaml.safe_load((REPO / "examples" / "quickstart-2node.yaml").read_text())
    job.update(name=name, image=image, resources={"cpus_per_node": 0.7, "memory": "2Gi", "shm": "256Mi"})
    job["train"]["plot"] = False
    job["k8s"] = {"flavor": flavor}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def k8s_run(path: Path, env: dict) -> tuple[float, float]:
    t0 = time.monotonic()
    proc = ddpkit("submit", "k8s", str(path), env=env)
    if proc.returncode != 0:
        sys.exit(f"submit failed: {proc.stderr}")
    handle = proc.stdout.strip()
    running = None
    try:
        while time.monotonic() - t0 < 900:
            state = ddpkit("status", handle, env=env).stdout.strip()
            now = time.monotonic() - t0
            if state == "RUNNING" and running is None:
                running = now
            if state == "SUCCEEDED":
                return (running if running is not None else now), now
            if state in ("FAILED", "CANCELLED"):
                sys.exit(f"{handle} {state}")
            time.sleep(0.25)
        sys.exit(f"{handle} did not finish in 900 s")
    finally:
        ddpkit("cancel", handle, env=env)
        while ddpkit("status", handle, env=env).returncode == 0:  # gone before the next run
            time.sleep(0.5)


def docker_run(path: Path, flavor: str, env: dict) -> tuple[float, float]:
    t0 = time.monotonic()
    proc = ddpkit("run", str(path), "--docker", "--flavor", flavor, env=env)
    total = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"run --docker failed: {proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if "ddpkit-summary " in line:
            return json.loads(line.split("ddpkit-summary ", 1)[1])["first_step_s"], total
    return float("nan"), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--image", default="ddpkit:test")
    parser.add_argument("--flavors", default="pytorchjob,trainjob,jobset,job")
    opts = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f} "
          f"on {os.cpu_count()} cores")

    cache = testbed.cache_dir()
    total = 0
    print("cold build (build.sh, per component, s):")
    listed = cache / "components"  # build.sh's current set (older versions may linger beside it)
    names = listed.read_text().split() if listed.exists() else [p.parent.name for p in cache.glob("*/.seconds")]
    for name in sorted(names):
        stamp = cache / name / ".seconds"
        if not stamp.exists():
            continue
        seconds = int(stamp.read_text())
        total += seconds
        print(f"  {name:48s} {seconds:6d}")
    print(f"  {'total':48s} {total:6d}")
    print(f"disk: binaries {du(cache, 'go-build', 'src')}, Go build cache {du(cache / 'go-build')}, "
          f"module sources {du(cache, 'go-build', 'bin', 'manifests')}, "
          f"images {du(Path(os.environ.get('DDPKIT_K8S_TESTBED_IMAGES', '/var/lib/ddpkit-k8s-images')))}")

    was_up = testbed.status(quiet=True)
    if not was_up:
        t0 = time.monotonic()
        testbed.up()
        print(f"warm bring-up: {time.monotonic() - t0:.1f} s")
    else:
        print("warm bring-up: not measured (the cluster was already up; never cycled here)")
    print(f"state dir while up: {du(testbed.testbed_dir())}")
    env = {**testbed.client_env(), "PYTHONPATH": str(REPO)}
    testbed.load_image(opts.image)
    try:
        print(f"\nper flavor, median of {opts.runs} (s): k8s submit->Running, submit->Succeeded | "
              "docker start->first step, start->exit")
        with tempfile.TemporaryDirectory(prefix="ddpkit-bench-k8s-") as tmp:
            for flavor in opts.flavors.split(","):
                path = job_file(Path(tmp), f"bench-{flavor}", opts.image, flavor)
                k8s = [k8s_run(path, env) for _ in range(opts.runs)]
                dock = [docker_run(path, flavor, env) for _ in range(opts.runs)]
                med = [statistics.median(x) for x in [*zip(*k8s, strict=True), *zip(*dock, strict=True)]]
                print(f"  {flavor:10s} k8s {med[0]:6.1f} {med[1]:6.1f} | docker {med[2]:6.1f} {med[3]:6.1f}",
                      flush=True)
    finally:
        if not was_up:
            testbed.down()
    print(f"load: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}")


if __name__ == "__main__":
    main()
