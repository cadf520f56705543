"""Kueue on the Kubernetes testbed: `k8s.queue` for every flavor, QUEUED, gang admission, preemption.

Kueue 0.18.4 runs as a host process beside the other controllers (`cluster.sh kueue`, started
here once), with its real webhooks, a ClusterQueue sized to the nodes' allocatable CPU, memory
and GPUs, and the LocalQueue `ddpkit` in namespace default. The testbed has 2 nodes of 2 CPUs:
4 CPUs of quota. The jobs here are "big": 3 pods x 0.8 CPU = 2.4 CPUs, 60% of the cluster, so
two of them never fit at once, and a node holds 2 of their pods (the cluster 4 pods in all).
Everything goes through the CLI and kubectl, as in tests/test_k8s_e2e.py (whose helpers these
are); the fixtures `cluster`, `image` and `handles` are tests/conftest.py's.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from deploy.testbed import k8s as testbed
from tests.conftest import REPO, ddpkit, k8s_report, require
from tests.test_k8s_e2e import (
    JOB_TIMEOUT_S,
    describe,
    job_file,
    kubectl,
    logs,
    metric_steps,
    pods,
    status_line,
    submit,
    summaries,
    wait_for,
    wait_for_line,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: the flavors Kueue 0.18.4 integrates, each tried once (how soon a queued job is admitted is a
#: figure of bench/kueue_admission.py, with its spread over repeated runs)
TRIALS = ["job", "pytorchjob", "jobset", "trainjob"]
BIG_PODS, BIG_CPUS = 3, 0.8


@pytest.fixture(scope="module")
def kueue(cluster, image):
    testbed.enable_kueue()
    return cluster


def big_job(tmp_path: Path, name: str, flavor: str, *, queue: bool = True, **train) -> Path:
    """3 pods x 1 process x 0.8 CPU (60% of the testbed's 4 CPUs), in the queue `ddpkit` unless
    `queue` is False; checkpoints every 20 steps to the test's hostPath volume."""
    path = job_file(tmp_path, name, flavor, **train)
    job = yaml.safe_load(path.read_text())
    job.update(nodes=BIG_PODS, procs_per_node=1)
    job["resources"].update(cpus_per_node=BIG_CPUS, memory="1536Mi")
    job["k8s"] = {"flavor": flavor, **({"queue": testbed.KUEUE_QUEUE} if queue else {})}
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def bound(cluster, name: str) -> list[dict]:
    """The job's pods that hold a node's resources: bound and not ended (a pod the kubelet
    rejected or that failed keeps its nodeName, and its job makes another)."""
    return [p for p in pods(cluster, name)
            if p["spec"].get("nodeName") and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]


def submit_together(cluster, handles, paths: list[Path]) -> list[str]:
    """Submit the jobs at the same moment (one thread each), as two users would."""
    out: dict[int, str] = {}

    def one(i: int) -> None:
        proc = ddpkit("submit", "k8s", str(paths[i]), env=cluster)
        assert proc.returncode == 0, proc.stderr
        out[i] = proc.stdout.strip()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handles.extend(out[i] for i in sorted(out))
    assert len(out) == len(paths), "a submit failed (see above)"
    return [out[i] for i in range(len(paths))]


def one_admitted_one_queued(cluster, a: str, b: str, timeout: float = 180) -> tuple[str, str]:
    """(admitted, queued): one job has all its pods bound, the other is QUEUED with no pod."""
    deadline = time.monotonic() + timeout
    names = {h: h.rsplit("/", 1)[1] for h in (a, b)}
    while True:
        placed = {h: len(bound(cluster, n)) for h, n in names.items()}
        full = [h for h, k in placed.items() if k == BIG_PODS]
        if full:
            [admitted] = full
            queued = b if admitted == a else a
            return admitted, queued
        assert time.monotonic() < deadline, f"no job placed whole: {placed}\n{describe(cluster, a)}"
        time.sleep(0.5)


def assert_waits_whole(cluster, handle: str) -> str:
    line = status_line(cluster, handle)
    assert line.startswith("QUEUED ("), line
    assert pods(cluster, handle.rsplit("/", 1)[1]) == [], "a queued job has pods"
    return line


def test_without_a_queue_two_big_jobs_start_partly(cluster, image, handles, tmp_path):
    """Why a user wants the queue: two jobs of 60% each, submitted together without one, take
    what the scheduler gives pod by pod; the cluster holds 4 of their 6 pods, so at least one
    job runs part of its pods, which hold their CPUs while its rendezvous waits for the rest
    (and when both got some, neither can ever finish: a deadlock)."""
    a, b = submit_together(cluster, handles, [big_job(tmp_path, f"q-none-{x}", "job", queue=False)
                                              for x in "ab"])
    deadline = time.monotonic() + 180
    while sum(len(bound(cluster, h.rsplit("/", 1)[1])) for h in (a, b)) < 4:
        assert time.monotonic() < deadline, describe(cluster, a)
        time.sleep(0.5)
    time.sleep(3)  # the scheduler has tried every pod
    placed = {h: len(bound(cluster, h.rsplit("/", 1)[1])) for h in (a, b)}
    assert sum(placed.values()) == 4, f"{placed}\n{describe(cluster, a)}"
    partial = [h for h, k in placed.items() if 0 < k < BIG_PODS]
    assert partial, placed
    line = wait_for_line(cluster, partial[0], "pods not scheduled")
    assert "Insufficient cpu" in line, line


@pytest.mark.parametrize("trial,flavor", list(enumerate(TRIALS)), ids=[f"{i}-{f}" for i, f in enumerate(TRIALS)])
def test_with_the_queue_one_runs_whole_the_other_waits_whole_then_is_admitted(kueue, handles, tmp_path, trial, flavor):
    """Gang admission: the same two jobs in the queue. One is admitted and placed whole; the
    other stays QUEUED in Kueue's words with no pod at all (no partial start, no deadlock), and
    is admitted within 10 s of the first one ending (cancelled here; ending by success is the
    preemption test's)."""
    paths = [big_job(tmp_path, f"q{trial}-{x}", flavor) for x in "ab"]
    for p in paths:  # cancelled, never finished: no checkpoint to wait for
        job = yaml.safe_load(p.read_text())
        job["k8s"]["termination_grace"] = "2s"
        p.write_text(yaml.safe_dump(job, sort_keys=False))
    a, b = submit_together(kueue, handles, paths)
    admitted, queued = one_admitted_one_queued(kueue, a, b)
    line = assert_waits_whole(kueue, queued)
    assert "insufficient unused quota for cpu" in line, line
    why = ddpkit("why", queued, env=kueue).stdout
    assert why.startswith("queued: Pending: ") and "insufficient unused quota for cpu" in why, why
    time.sleep(2)
    assert_waits_whole(kueue, queued)  # still whole: nothing starts it piecemeal
    assert ddpkit("cancel", admitted, env=kueue, timeout=360).returncode == 0
    ended = time.monotonic()
    while (state := k8s_report(kueue, queued).state) == "QUEUED":  # until admitted (a bounded wait)
        assert time.monotonic() - ended < 180, f"never admitted: {status_line(kueue, queued)}"
        time.sleep(0.2)
    # admitted: Kueue may admit it as soon as the first job is being deleted, so on a loaded
    # machine it can have run to its end while `cancel` still waited for the first one's pods
    assert state in ("PENDING", "RUNNING", "SUCCEEDED"), status_line(kueue, queued)
    print(f"kueue trial {trial} ({flavor}): admitted {time.monotonic() - ended:.1f} s after the first job ended")
    deadline = time.monotonic() + 120
    while len(bound(kueue, queued.rsplit("/", 1)[1])) < BIG_PODS:
        assert time.monotonic() < deadline, describe(kueue, queued)
        time.sleep(0.5)


PRIORITY_CLASSES = [{"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                     "metadata": {"name": name}, "value": value, "preemptionPolicy": "Never",
                     "description": "ddpkit tests (Kueue preemption)"}
                    for name, value in (("ddpkit-test-low", 100), ("ddpkit-test-high", 1000))]


def test_a_higher_priority_job_preempts_a_lower_one_which_resumes_bit_exact(kueue, handles, tmp_path):
    """Kueue preempts a running low-priority job for a high-priority one (the ClusterQueue's
    withinClusterQueue: LowerPriority): the low job is suspended, its pods get SIGTERM and
    checkpoint, it waits QUEUED (Preempted), the high job runs, and once it ends the low job is
    readmitted and resumes from its checkpoint. The high job trains the same model from the
    same seed uninterrupted: the final parameters are identical, bit for bit."""
    kubectl(kueue, "apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in PRIORITY_CLASSES))
    for d in ("low", "high"):
        (tmp_path / d).mkdir()
    low_path = big_job(tmp_path / "low", "q-low", "job", max_steps=120, epochs=100)
    high_path = big_job(tmp_path / "high", "q-high", "job", max_steps=120, epochs=100)
    for path, priority in ((low_path, "ddpkit-test-low"), (high_path, "ddpkit-test-high")):
        job = yaml.safe_load(path.read_text())
        job["k8s"]["priority_class"] = priority
        path.write_text(yaml.safe_dump(job, sort_keys=False))
    low = submit(kueue, handles, low_path)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while max(metric_steps(tmp_path / "low" / "out"), default=0) < 30:  # past the checkpoint at 20
        assert time.monotonic() < deadline, describe(kueue, low)
        time.sleep(0.5)
    high = submit(kueue, handles, high_path)
    line = wait_for_line(kueue, low, "QUEUED (", timeout=120)
    assert "Preempted" in line, line
    wait_for(kueue, high, {"SUCCEEDED"})
    ended = time.monotonic()
    while k8s_report(kueue, low).state == "QUEUED":
        assert time.monotonic() - ended < 30, status_line(kueue, low)
        time.sleep(0.2)
    print(f"kueue preemption: the preempted job readmitted {time.monotonic() - ended:.1f} s after the other ended")
    wait_for(kueue, low, {"SUCCEEDED"})
    # the preempted attempt's last record (rank 0 writes it to the run directory): stopped by
    # SIGTERM after its checkpoint, and the readmitted pods resumed from that very step
    stopped = json.loads((tmp_path / "low" / "out" / "q-low" / "attempts" / "attempt-0.json").read_text())
    assert stopped["state"] == "stopped" and stopped["step"] >= 30, stopped
    [final] = summaries(logs(kueue, low, 0))  # the readmitted pods' log
    assert final["resumed_from_step"] == stopped["step"], (stopped, final)
    [uninterrupted] = summaries(logs(kueue, high, 0))
    assert final["steps"] == uninterrupted["steps"] == 120
    assert not uninterrupted.get("resumed_from_step"), uninterrupted
    assert {r["params_sha256"] for r in final["ranks"]} == {r["params_sha256"] for r in uninterrupted["ranks"]}
    assert len({r["params_sha256"] for r in final["ranks"]}) == 1


# --------------------------------------------------------------------------------------------
# issue 19 item 5: topology-aware scheduling on kwok fake nodes


def test_topology_places_each_flavor_in_the_fewest_racks_with_ranks_in_rack_order(kueue, handles, tmp_path):
    """16 kwok fake nodes (2 racks of 8 x 8 GPUs) and their Kueue queue (a Topology zone/rack/node):
    a 16-node GPU job of each flavor with `k8s.topology` (rack, preferred) is bound one pod per
    node, node ranks 0-7 in one rack and 8-15 in the other; a PyTorchJob's Master is a pod set
    of its own, placed apart from its Workers' rank order (docs/kubernetes.md "Topology"), so there the
    Workers' ranks 1-15 are the ones in rack order."""
    from deploy.k8s.submit import pods_by_rank

    require((testbed.bin_dir() / "kwok").exists(), "kwok is not built (bash k8s/testbed/build.sh kwok)")
    key, value = testbed.FAKE_NODE_LABEL
    testbed.fake_nodes(16)
    try:
        for flavor in ("job", "pytorchjob", "jobset", "trainjob"):
            name = f"e2e-tas-{flavor}"
            job = yaml.safe_load((REPO / "examples" / "quickstart-2node.yaml").read_text())
            job.pop("procs_per_node", None)
            job.update(name=name, image="ddpkit:test", nodes=16, gpus_per_node=8,
                       resources={"cpus_per_node": 4, "memory": "16Gi", "shm": "1Gi"})
            job["k8s"] = {"flavor": flavor, "queue": testbed.FAKE_QUEUE, "node_selector": {key: value},
                          "termination_grace": "1s", "topology": {"level": "ddpkit.io/rack", "required": False}}
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(job, sort_keys=False))
            handle = submit(kueue, handles, path)
            deadline = time.monotonic() + 180
            while len(placed := [p for p in pods(kueue, name) if p["spec"].get("nodeName")]) < 16:
                assert time.monotonic() < deadline, describe(kueue, handle)
                time.sleep(1)
            racks = {n["metadata"]["name"]: n["metadata"]["labels"]["ddpkit.io/rack"] for n in json.loads(
                kubectl(kueue, "get", "nodes", "-l", f"{key}={value}", "-o", "json").stdout)["items"]}
            by_rank = pods_by_rank(flavor, placed)
            order = [racks[by_rank[r]["spec"]["nodeName"]] for r in sorted(by_rank)]
            assert sorted(by_rank) == list(range(16)) and len({p["spec"]["nodeName"] for p in placed}) == 16
            ranked = order[1:] if flavor == "pytorchjob" else order
            changes = sum(a != b for a, b in zip(ranked, ranked[1:], strict=False))
            assert len(set(order)) == 2 and changes == 1, order
            ddpkit("cancel", handle, "--wait", "0", env=kueue)
            while pods(kueue, name):
                assert time.monotonic() < deadline + 120, describe(kueue, handle)
                time.sleep(1)
    finally:
        testbed.fake_nodes(0)
