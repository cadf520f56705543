"""A node dies mid-run on the Kubernetes testbed: per flavor, how long until training runs again.

Per flavor, quickstart-2node (one pod per node, restarts 2, checkpoints every 20 steps on a
hostPath both nodes see) trains past step 50; then node rank 1's node is killed whole
(`testbed.kill_node`: link down, kubelet, containerd and its containers). Timed from the kill:

  - NotReady: the node's Ready condition leaves True (the controller-manager's node monitor
    grace period: 20 s on the testbed, 40-50 s by default);
  - tainted: right then the bench taints the node `node.kubernetes.io/out-of-service`, as an
    admin or a node-health agent would (Kubernetes' non-graceful node shutdown; without it a
    pod on an unreachable node is never confirmed dead and never replaced);
  - training again: the first step record appended to the run's metrics.jsonl after the taint
    (the replacement pods restored the last checkpoint and trained a step).

The node is revived after each flavor (`testbed.revive_node`). Needs root, the testbed up with
2 or more nodes and the image loaded (tests/test_k8s_e2e.py's fixtures, or
`ddpkit testbed k8s up` and `testbed.load_image`).
Usage: python bench/k8s_node_loss.py [--image ddpkit:test] [--flavors job,pytorchjob,jobset,trainjob]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_common import Result, fmt  # noqa: E402
from bench.k8s_testbed import ddpkit, job_file  # noqa: E402
from deploy.testbed import k8s as testbed  # noqa: E402

OUT_OF_SERVICE = "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute"
INSTANCE = "app.kubernetes.io/instance"
NODE_RANK_1 = {"job": ("batch.kubernetes.io/job-completion-index", "1"),
               "pytorchjob": ("training.kubeflow.org/replica-type", "worker"),
               "jobset": ("batch.kubernetes.io/job-completion-index", "1"),
               "trainjob": ("batch.kubernetes.io/job-completion-index", "1")}


def kubectl(env: dict, *args: str) -> str:
    return subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, check=True).stdout


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def wait(what: str, predicate, timeout: float = 600) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        time.sleep(0.5)
    return time.monotonic()


def victim_node(env: dict, name: str, flavor: str) -> str:
    key, value = NODE_RANK_1[flavor]
    pods = json.loads(kubectl(env, "get", "pods", "-l", f"{INSTANCE}={name}", "-o", "json"))["items"]
    for pod in pods:
        meta = pod["metadata"]
        if {**meta.get("labels", {}), **meta.get("annotations", {})}.get(key) == value:
            return pod["spec"]["nodeName"]
    raise RuntimeError(f"{name}: no pod of node rank 1 among {[p['metadata']['name'] for p in pods]}")


def one_flavor(flavor: str, image: str, env: dict, tmp: Path) -> dict:
    out = tmp / flavor
    out.mkdir()
    os.chmod(out, 0o777)  # the image runs as uid 1000
    name = f"bench-loss-{flavor}"
    path = job_file(tmp, name, image, flavor)
    job = yaml.safe_load(path.read_text())
    job["restarts"] = 2
    job["volumes"] = [{"name": "out", "mount": "/out", "host_path": str(out)}]
    job["train"].update(output_dir="/out", max_steps=100000, epochs=1000)
    job["k8s"]["one_pod_per_node"] = True
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    handle = ddpkit("submit", "k8s", str(path), env=env).stdout.strip()
    run_dir = out / name
    try:
        wait("step 50", lambda: steps_logged(run_dir) >= 50)
        node = victim_node(env, name, flavor)
        killed = time.monotonic()
        testbed.kill_node(int(node.rsplit("-", 1)[1]))
        try:
            ready = "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}"
            not_ready = wait("NotReady", lambda: kubectl(env, "get", "node", node, "-o", ready).strip() != "True")
            kubectl(env, "taint", "node", node, OUT_OF_SERVICE)
            logged = steps_logged(run_dir)
            again = wait("training again", lambda: steps_logged(run_dir) > logged)
        finally:
            testbed.revive_node(int(node.rsplit("-", 1)[1]))
    finally:
        ddpkit("cancel", handle, "--wait", "120", env=env)
    return {"flavor": flavor, "node": node, "not_ready_s": not_ready - killed, "again_s": again - killed}


def bench_args(doc: str, flavors: str, **counts: int) -> tuple[argparse.Namespace, dict]:
    """The testbed benches' options (--image, --flavors, and `counts` as int options) and the
    environment that points `ddpkit` and `kubectl` at the testbed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--image", default="ddpkit:test")
    parser.add_argument("--flavors", default=flavors)
    for name, default in counts.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser.parse_args(), {**testbed.client_env(), "PYTHONPATH": str(REPO)}


def main() -> None:
    args, env = bench_args(__doc__, "job,pytorchjob,jobset,trainjob")
    res = Result("k8s_node_loss", "k8s testbed: a node dies mid-run, kill to training again per flavor")
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="ddpkit-node-loss-") as tmp:
        os.chmod(tmp, 0o755)
        for flavor in args.flavors.split(","):
            result = one_flavor(flavor, args.image, env, Path(tmp))
            print(json.dumps(result), flush=True)
            runs.append(result)
            rows.append([flavor, fmt(result["not_ready_s"], ".0f"), fmt(result["again_s"], ".0f"),
                         fmt(result["again_s"] - result["not_ready_s"], ".0f")])
    res.text("Node rank 1's node killed whole past step 50 (restarts 2, one pod per node, checkpoints "
             "every 20 steps on a hostPath); the node tainted out-of-service as soon as it is NotReady "
             "(the testbed's node monitor grace period is 20 s; Kubernetes' default 40-50 s); training "
             "again = the first step record after the taint.")
    res.table("kill -> NotReady -> training again, per flavor (one kill each)",
              ["flavor", "kill -> NotReady s", "kill -> training again s", "taint -> training again s"], rows)
    res.doc["data"]["runs"] = runs
    res.save()

if __name__ == "__main__":
    main()
