"""Scheduling at scale on the Kubernetes testbed: kwok fake GPU nodes beside the real ones.

`cluster.sh fake-nodes 64` adds 64 fake nodes (8 nvidia.com/gpu, 32 CPUs each, 8 per rack:
`ddpkit.io/rack: fake-rack-0..7`, tainted kwok.x-k8s.io/node=fake:NoSchedule); kwok plays
their kubelets. For each flavor and job size (8, 32 and 64 nodes x 8 GPUs, rendered as a user
renders a GPU job, plus a toleration of the fake taint and a nodeSelector for the fake nodes),
the figure is `ddpkit submit k8s` -> every pod bound by the real kube-scheduler, with the
controllers' pod creation in it; then the placement: one pod per node (8 GPUs a pod, 8 a node),
how many racks the job spans (the fewest is size/8) and whether node ranks are contiguous per
rack. No topology is asked for here (plain scheduler): the rack figures show what a user gets
without it. The fake nodes are removed at the end.

Needs root, the testbed with kwok built (`bash k8s/testbed/build.sh kwok`).
Usage: python bench/k8s_scale.py [--sizes 8 32 64] [--flavors job,pytorchjob,jobset,trainjob]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_common import Result  # noqa: E402

from deploy.k8s.submit import pods_by_rank  # noqa: E402
from deploy.testbed import k8s as testbed  # noqa: E402


def ddpkit(env: dict, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "deploy", *args], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"ddpkit {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def job_pods(env: dict, name: str) -> list[dict]:
    out = subprocess.run([testbed.kubectl(), "get", "pods", "-l", f"app.kubernetes.io/instance={name}", "-o", "json"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["items"]


def job_file(tmp: Path, name: str, flavor: str, nodes: int, image: str, topology: dict | None = None) -> Path:
    job = yaml.safe_load((REPO / "examples" / "quickstart-2node.yaml").read_text())
    job.pop("procs_per_node", None)
    job.update(name=name, image=image, nodes=nodes, gpus_per_node=8,
               resources={"cpus_per_node": 4, "memory": "16Gi", "shm": "1Gi"})
    key, value = testbed.FAKE_NODE_LABEL
    job["k8s"] = {"flavor": flavor, "node_selector": {key: value}, "termination_grace": "1s",
                  "tolerations": [{"key": testbed.FAKE_NODE_TAINT["key"], "operator": "Exists",
                                   "effect": testbed.FAKE_NODE_TAINT["effect"]}]}
    if topology:  # through the fake nodes' Kueue queue, whose flavor names their Topology
        job["k8s"].update(queue=testbed.FAKE_QUEUE, topology=topology)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def measure(env: dict, tmp: Path, flavor: str, nodes: int, image: str, topology: dict | None = None) -> dict:
    name = f"scale-{flavor}-{nodes}"
    path = job_file(tmp, name, flavor, nodes, image, topology)
    t0 = time.monotonic()
    handle = ddpkit(env, "submit", "k8s", str(path))
    try:
        while True:
            pods = job_pods(env, name)
            bound = [p for p in pods if p["spec"].get("nodeName")]
            if len(bound) >= nodes:
                break
            if time.monotonic() - t0 > 600:
                raise SystemExit(f"{name}: {len(bound)} of {nodes} pods bound after 600 s")
            time.sleep(0.2)
        took = time.monotonic() - t0
        rack = {f"kwok-node-{i}": f"fake-rack-{i // testbed.FAKE_RACK_SIZE}" for i in range(1024)}
        by_rank = pods_by_rank(flavor, pods)
        racks_in_rank_order = [rack.get(by_rank[r]["spec"]["nodeName"], "?") for r in sorted(by_rank)]
        changes = sum(1 for a, b in zip(racks_in_rank_order, racks_in_rank_order[1:], strict=False) if a != b)
        asked = topology and f"{topology['level']} ({'required' if topology['required'] else 'preferred'})"
        runs = [[racks_in_rank_order[0], 0]] if racks_in_rank_order else []
        for r in racks_in_rank_order:  # run lengths: fake-rack-3 x1, fake-rack-0 x8, ...
            if r != runs[-1][0]:
                runs.append([r, 0])
            runs[-1][1] += 1
        return {"flavor": flavor, "nodes": nodes, "topology": asked or "none", "scheduled_s": took,
                "racks_in_rank_order": " ".join(f"{r.rsplit('-', 1)[-1]}x{n}" for r, n in runs),
                "distinct_nodes": len({p["spec"]["nodeName"] for p in bound}),
                "racks": len(set(racks_in_rank_order)), "fewest_racks": -(-nodes // testbed.FAKE_RACK_SIZE),
                "ranks_contiguous_per_rack": changes == len(set(racks_in_rank_order)) - 1}
    finally:
        cancel(env, handle, name)


def cancel(env: dict, handle: str, name: str) -> None:
    """`ddpkit cancel --wait 0`, then until the job's pods are gone (kwok deletes them); a job
    still there after 300 s is reported and deleted in the background."""
    ddpkit(env, "cancel", handle, "--wait", "0")
    deadline = time.monotonic() + 300
    while job_pods(env, name):
        if time.monotonic() > deadline:
            print(f"  {handle}: pods still there 300 s after cancel; deleting in the background", flush=True)
            kind = handle.split("/")[3]
            subprocess.run([testbed.kubectl(), "delete", kind, name, "--cascade=background", "--wait=false"],
                           env=env, capture_output=True)
            return
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--flavors", default="job,pytorchjob,jobset,trainjob")
    ap.add_argument("--image", default="ddpkit:test")
    ap.add_argument("--topology", metavar="LEVEL", help="ask Kueue for topology-aware scheduling at this node "
                    "label (k8s.topology, through the fake nodes' queue: the testbed up with --kueue)")
    ap.add_argument("--preferred", action="store_true", help="with --topology: preferred, not required")
    args = ap.parse_args()
    topology = {"level": args.topology, "required": not args.preferred} if args.topology else None
    env = {**testbed.client_env(), "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    testbed.fake_nodes(max(args.sizes))
    print(f"{max(args.sizes)} kwok fake nodes up in {time.monotonic() - t0:.0f} s")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for nodes in args.sizes:
                for flavor in args.flavors.split(","):
                    rows.append(measure(env, Path(tmp), flavor, nodes, args.image, topology))
                    r = rows[-1]
                    print(f"{flavor:<11} {nodes:>3} nodes x 8 GPUs: all pods bound {r['scheduled_s']:6.1f} s; "
                          f"{r['distinct_nodes']} distinct nodes; {r['racks']} racks (fewest {r['fewest_racks']}); "
                          f"ranks contiguous per rack: {r['ranks_contiguous_per_rack']} "
                          f"(rack x ranks, in rank order: {r['racks_in_rank_order']})", flush=True)
    finally:
        testbed.fake_nodes(0)
    report(rows, topology).save()


COLUMNS = ["flavor", "nodes", "topology asked", "all pods bound (s)", "distinct nodes", "racks", "fewest racks",
           "ranks contiguous per rack"]


def report(rows: list[dict], topology: dict | None = None) -> Result:
    """The rows as a bench result (bench/report.py draws BENCHMARKS.md from it): k8s_scale, or
    k8s_scale_topology when Kueue's topology-aware scheduling was asked for."""
    if topology:
        res = Result("k8s_scale_topology", "k8s testbed + kwok + Kueue topology-aware scheduling: "
                     "racks spanned and rank order at 8/32/64 fake GPU nodes")
        res.text(f"As k8s_scale, with `k8s.topology: {json.dumps(topology)}` and `k8s.queue: "
                 f"{testbed.FAKE_QUEUE}` (the fake nodes' ClusterQueue, whose ResourceFlavor names the Topology "
                 f"{testbed.FAKE_TOPOLOGY}: {', '.join(testbed.FAKE_TOPOLOGY_LEVELS)}).")
    else:
        res = Result("k8s_scale", "k8s testbed + kwok: submit -> every pod bound at 8/32/64 fake GPU nodes")
        res.text(__doc__.split("\n\nNeeds root")[0])
    res.table("submit -> every pod bound by the real scheduler, per flavor and job size (8 GPUs a pod)", COLUMNS,
              [[r["flavor"], r["nodes"], r.get("topology", "none"), round(r["scheduled_s"], 1), r["distinct_nodes"], r["racks"],
                r["fewest_racks"], r["ranks_contiguous_per_rack"]] for r in rows])
    res.doc["data"]["rows"] = rows
    return res


if __name__ == "__main__":
    main()
