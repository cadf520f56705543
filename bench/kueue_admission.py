"""Kueue on the Kubernetes testbed: how soon a queued job is admitted once capacity frees, per flavor.

Two jobs of 3 pods x 0.8 CPU (60% of the 2-node testbed's 4 CPUs) are submitted together to
the LocalQueue `ddpkit`; Kueue admits one whole and holds the other QUEUED. Once every pod of
the first is placed it is cancelled (`ddpkit cancel`, which returns when the job is gone); the
figure is the time from then to the second job leaving QUEUED (Kueue unsuspended it), and to
all its pods being placed by the scheduler. Median of --runs per flavor.

Needs root, the testbed's binaries (Kueue is started on the running cluster, or the cluster is
brought up with it) and the test image in the cluster (`python -m deploy.testbed.k8s load
ddpkit:test`). Usage: python bench/kueue_admission.py [--runs 3] [--image ddpkit:test]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deploy.testbed import k8s as testbed  # noqa: E402

FLAVORS = ["job", "pytorchjob", "jobset", "trainjob"]


def ddpkit(env: dict, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "deploy", *args], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"ddpkit {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def placed(env: dict, name: str) -> int:
    out = subprocess.run([testbed.kubectl(), "get", "pods", "-l", f"app.kubernetes.io/instance={name}", "-o", "json"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return sum(1 for p in json.loads(out)["items"] if p["spec"].get("nodeName"))


def job_file(tmp: Path, name: str, image: str, flavor: str) -> Path:
    job = yaml.safe_load((REPO / "examples" / "quickstart-2node.yaml").read_text())
    job.update(name=name, image=image, nodes=3, procs_per_node=1,
               resources={"cpus_per_node": 0.8, "memory": "1536Mi", "shm": "256Mi"})
    job["train"].update(plot=False, max_steps=100000, epochs=1000)
    job["k8s"] = {"flavor": flavor, "queue": testbed.KUEUE_QUEUE, "termination_grace": "2s"}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def until(what: str, check, timeout: float = 300) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


def one_run(env: dict, tmp: Path, image: str, flavor: str, run: int) -> tuple[float, float]:
    names = [f"kq-{flavor}-{run}-{x}" for x in "ab"]
    handles: dict[str, str] = {}
    threads = [threading.Thread(target=lambda n=n: handles.__setitem__(n, ddpkit(env, "submit", "k8s", str(job_file(tmp, n, image, flavor)))))
               for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        until("one job placed whole", lambda: any(placed(env, n) == 3 for n in names))
        first = next(n for n in names if placed(env, n) == 3)
        second = next(n for n in names if n != first)
        ddpkit(env, "cancel", handles[first])
        admitted = until("admission", lambda: not ddpkit(env, "status", handles[second]).startswith("QUEUED"))
        running = admitted + until("placement", lambda: placed(env, second) == 3)
        return admitted, running
    finally:
        for h in handles.values():
            subprocess.run([sys.executable, "-m", "deploy", "cancel", h, "--wait", "0"], env=env, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--image", default="ddpkit:test")
    args = ap.parse_args()
    testbed.up()
    testbed.enable_kueue()
    testbed.load_image(args.image)
    env = {**testbed.client_env(), "PYTHONPATH": str(REPO)}
    print(f"Kueue admission on the testbed, 2 jobs of 60% submitted together, median of {args.runs}")
    print(f"{'flavor':<12} {'end -> admitted':>16} {'end -> all pods placed':>23}")
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in FLAVORS:
            runs = [one_run(env, Path(tmp), args.image, flavor, r) for r in range(args.runs)]
            admitted = statistics.median(a for a, _ in runs)
            placed_s = statistics.median(b for _, b in runs)
            print(f"{flavor:<12} {admitted:>15.1f}s {placed_s:>22.1f}s")


if __name__ == "__main__":
    main()
