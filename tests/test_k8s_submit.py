"""deploy.k8s.submit with a fake cluster: submit, status, logs, cancel, API errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import yaml

from deploy.errors import RuntimeFailure, UserError
from deploy.k8s import FLAVORS, flavor_of_kind
from deploy.k8s import cluster as seam
from deploy.k8s import submit as sub
from deploy.k8s.pytorchjob import REPLICA_INDEX_LABEL as PYTORCHJOB_REPLICA_INDEX
from deploy.k8s.pytorchjob import REPLICA_TYPE_LABEL as PYTORCHJOB_REPLICA_TYPE
from deploy.kube import COMPLETION_INDEX_KEY, FLAVOR_KIND, KUEUE_QUEUE_LABEL
from deploy.load import parse_job
from deploy.logs import Query
from tests.builders import BASE
from tests.conftest import REPO


class FakeCluster:
    """In-memory API server: objects by (kind, namespace, name); errors injected per call."""

    def __init__(self, errors=None, pods=(), logs=None):
        self.objects: dict[tuple, dict] = {}
        self.calls: list[tuple] = []
        self.errors = errors or {}  # (verb, kind) -> ApiError
        self._pods = list(pods)
        self._logs = logs or {}
        self.node_labels: dict[str, dict[str, str]] = {}
        self.propagation: dict[str, str] = {}  # kind -> the propagationPolicy of its last delete

    def _maybe_fail(self, verb, kind):
        if (verb, kind) in self.errors:
            raise self.errors[(verb, kind)]

    def apply(self, obj, *, dry_run):
        """Server-side apply: create, or replace what this manager owns (all of it here)."""
        kind, meta = obj["kind"], obj["metadata"]
        self.calls.append(("apply", kind, meta["name"], dry_run))
        self._maybe_fail("apply", kind)
        key = (kind, meta["namespace"], meta["name"])
        uid = (self.objects.get(key) or {}).get("metadata", {}).get("uid") or f"uid-{kind}-{meta['name']}"
        answer = {**obj, "metadata": {**meta, "uid": uid}}
        if not dry_run:
            self.objects[key] = answer
        return answer

    def get(self, kind, namespace, name):
        self.calls.append(("get", kind, name))
        self._maybe_fail("get", kind)
        try:
            return self.objects[(kind, namespace, name)]
        except KeyError:
            raise seam.ApiError(404, "NotFound", f"{name} not found") from None

    def delete(self, kind, namespace, name, propagation="Foreground"):
        self.calls.append(("delete", kind, name))
        self.propagation[kind] = propagation
        self._maybe_fail("delete", kind)
        if self.objects.pop((kind, namespace, name), None) is None:
            raise seam.ApiError(404, "NotFound", f"{name} not found")

    def pods(self, namespace, selector):
        self.calls.append(("pods", selector))
        return self._pods

    def events(self, namespace, pod, reason):
        self.calls.append(("events", pod, reason))
        return []

    def listed(self, kind, namespace, selector):
        self.calls.append(("listed", kind, selector))
        key, _, value = selector.partition("=")
        return [o for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace
                and (o.get("metadata", {}).get("labels") or {}).get(key) == value]

    def log(self, namespace, pod, container, follow, tail_lines=None, previous=False):
        self.calls.append(("log", pod, container, follow) + (("previous",) if previous else ()))
        yield from self._logs.get(pod + (" previous" if previous else ""), [])

    def nodes(self, selector):
        """Nodes (self.node_labels: name -> labels) that have the label key `selector`."""
        self.calls.append(("nodes", selector))
        self._maybe_fail("nodes", "Node")
        return [{"metadata": {"name": n, "labels": dict(labels)}}
                for n, labels in sorted(self.node_labels.items()) if selector in labels]

    def label_node(self, node, key, value):
        self.calls.append(("label_node", node, key, value))
        self._maybe_fail("label_node", "Node")
        labels = self.node_labels.setdefault(node, {})
        if value is None:
            labels.pop(key, None)
        else:
            labels[key] = value


def job(**fields):
    return parse_job({**BASE, "nodes": 2, "k8s": {"namespace": "ml"}, **fields})


def test_submit_creates_every_object_in_order_and_prints_the_handle():
    cluster = FakeCluster()
    handle = sub.submit(job(), flavor="job", cluster=cluster)
    assert handle == "k8s://ml/job/demo"
    assert [c[1:3] for c in cluster.calls if c[0] == "apply"][:3] == [
        ("ConfigMap", "demo-job"), ("Service", "demo"), ("Job", "demo")]
    assert set(cluster.objects) == {("ConfigMap", "ml", "demo-job"), ("Service", "ml", "demo"),
                                    ("Job", "ml", "demo")}


def test_submit_dry_run_asks_the_server_and_persists_nothing():
    cluster = FakeCluster()
    out = sub.submit(job(), flavor="pytorchjob", dry_run=True, cluster=cluster)
    assert out.startswith("k8s://ml/pytorchjob/demo")
    assert all(c[3] is True for c in cluster.calls if c[0] == "apply") and cluster.objects == {}


def test_submit_uses_the_job_flavor_by_default():
    cluster = FakeCluster()
    assert sub.submit(job(k8s={"namespace": "ml", "flavor": "jobset"}), cluster=cluster) == "k8s://ml/jobset/demo"
    assert ("JobSet", "ml", "demo") in cluster.objects


def test_missing_crd_is_one_line_and_rolls_back_the_configmap():
    cluster = FakeCluster(errors={("apply", "PyTorchJob"): seam.ApiError(404, "NotFound", "404 page not found")})
    with pytest.raises(RuntimeFailure) as err:
        sub.submit(job(), flavor="pytorchjob", cluster=cluster)
    msg = str(err.value)
    assert msg == ("create PyTorchJob ml/demo: the cluster does not serve PyTorchJob (kubeflow.org/v1); "
                   "install the Kubeflow training operator (v1), or use --flavor job (needs no operator)")
    assert cluster.objects == {}  # nothing half-submitted
    assert ("delete", "ConfigMap", "demo-job") in cluster.calls


def test_already_exists_is_one_line_and_keeps_the_existing_job():
    cluster = FakeCluster()
    sub.submit(job(), flavor="jobset", cluster=cluster)
    with pytest.raises(RuntimeFailure) as err:
        sub.submit(job(), flavor="jobset", cluster=cluster)
    assert "create JobSet ml/demo: already exists; cancel it first" in str(err.value)
    assert ("JobSet", "ml", "demo") in cluster.objects


def test_forbidden_names_the_resource_and_namespace():
    cluster = FakeCluster(errors={("apply", "ConfigMap"): seam.ApiError(403, "Forbidden", "no")})
    with pytest.raises(RuntimeFailure) as err:
        sub.submit(job(), flavor="job", cluster=cluster)
    assert str(err.value) == ("create ConfigMap ml/demo-job: forbidden (403): you may not create "
                              "configmaps in namespace ml; ask a cluster admin for the RBAC rights")


def test_missing_namespace_and_unreachable_api_are_one_line():
    err = seam.ApiError(404, "NotFound", 'namespaces "ml" not found', "namespaces")
    assert seam.explain(err, "ConfigMap", "ml", "x", "create") == (
        "create ConfigMap ml/x: namespace 'ml' does not exist; create it or set k8s.namespace")
    down = seam.ApiError(0, "Unreachable", "cannot reach the Kubernetes API at https://10.0.0.1")
    assert "check the cluster address" in seam.explain(down, "Job", "ml", "x", "create")


def test_api_exception_from_the_real_client_becomes_an_api_error():
    from kubernetes.client import ApiException

    exc = ApiException(status=404, reason="Not Found")
    exc.body = json.dumps({"kind": "Status", "message": 'namespaces "ml" not found',
                           "details": {"name": "ml", "kind": "namespaces"}})
    err = seam.api_error_from(exc)
    assert (err.status, err.message, err.details_kind) == (404, 'namespaces "ml" not found', "namespaces")
    plain = ApiException(status=404, reason="Not Found")
    plain.body = "404 page not found"
    assert seam.api_error_from(plain).message == "404 page not found"


@pytest.mark.parametrize("text", ["k8s://ml/pytorchjob", "slurm://1", "k8s://ml/cronjob/x",
                                  "k8s://ML/job/x"])
def test_bad_handles_are_user_errors(text):
    with pytest.raises(UserError):
        seam.parse_handle(text)


QUEUED_META = {"metadata": {"labels": {KUEUE_QUEUE_LABEL: "team-a"}}}


def conditions(*pairs):
    return {"status": {"conditions": [{"type": t, "status": s} for t, s in pairs]}}


@pytest.mark.parametrize("kind,obj,state", [
    ("PyTorchJob", {}, "PENDING"),
    ("PyTorchJob", conditions(("Created", "True")), "PENDING"),
    ("PyTorchJob", conditions(("Created", "True"), ("Running", "True")), "RUNNING"),
    ("PyTorchJob", conditions(("Created", "True"), ("Running", "False"), ("Restarting", "True")), "RESTARTING"),
    ("PyTorchJob", conditions(("Created", "True"), ("Running", "False"), ("Succeeded", "True")), "SUCCEEDED"),
    ("PyTorchJob", conditions(("Created", "True"), ("Running", "False"), ("Failed", "True")), "FAILED"),
    ("Job", {"status": {"active": 2, "ready": 2}}, "RUNNING"),
    ("Job", {"status": {"active": 2, "failed": 1}}, "RESTARTING"),
    ("Job", {"status": {}}, "PENDING"),
    ("Job", conditions(("Suspended", "True")), "PENDING"),
    ("Job", conditions(("SuccessCriteriaMet", "True"), ("Complete", "True")), "SUCCEEDED"),
    ("Job", conditions(("FailureTarget", "True"), ("Failed", "True")), "FAILED"),
    ("JobSet", {"status": {"replicatedJobsStatus": [{"name": "node", "active": 1, "ready": 1}]}}, "RUNNING"),
    ("JobSet", {"status": {"restarts": 1, "replicatedJobsStatus": [{"name": "node", "active": 1}]}}, "RESTARTING"),
    ("JobSet", conditions(("Completed", "True")), "SUCCEEDED"),
    ("JobSet", conditions(("Failed", "True")), "FAILED"),
    ("TrainJob", conditions(("Suspended", "True")), "PENDING"),
    ("TrainJob", {"status": {"jobsStatus": [{"name": "node", "active": 2, "ready": 2}]}}, "RUNNING"),
    ("TrainJob", conditions(("Complete", "True")), "SUCCEEDED"),
    ("TrainJob", conditions(("Failed", "True")), "FAILED"),
    ("Job", {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {"active": 1}}, "CANCELLED"),
    # held by Kueue: its queue label and the flavor's suspend field (each flavor has its own)
    ("Job", {**QUEUED_META, "spec": {"suspend": True}, **conditions(("Suspended", "True"))}, "QUEUED"),
    ("Job", {**QUEUED_META, "spec": {"suspend": False}, "status": {"active": 2, "ready": 2}}, "RUNNING"),
    ("Job", {"spec": {"suspend": True}, **conditions(("Suspended", "True"))}, "PENDING"),  # no queue
    ("Job", {**QUEUED_META, "spec": {"suspend": True}, **conditions(("Complete", "True"))}, "SUCCEEDED"),
    ("PyTorchJob", {**QUEUED_META, "spec": {"runPolicy": {"suspend": True}}}, "QUEUED"),
    ("PyTorchJob", {**QUEUED_META, "spec": {"suspend": True}}, "PENDING"),  # not where a PyTorchJob says it
    ("JobSet", {**QUEUED_META, "spec": {"suspend": True}}, "QUEUED"),
    ("TrainJob", {**QUEUED_META, "spec": {"suspend": True}, **conditions(("Suspended", "True"))}, "QUEUED"),
])
def test_status_maps_each_flavor_to_the_shared_vocabulary(kind, obj, state):
    assert sub.status_from(kind, obj) == state
    assert state in sub.STATES


def test_status_reads_the_workload_and_reports_a_missing_job_in_one_line():
    cluster = FakeCluster()
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)
    cluster.objects[("PyTorchJob", "ml", "demo")]["status"] = {
        "conditions": [{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}]}
    assert sub.status("k8s://ml/pytorchjob/demo", cluster=cluster) == "RUNNING"
    with pytest.raises(RuntimeFailure) as err:
        sub.status("k8s://ml/pytorchjob/other", cluster=cluster)
    assert str(err.value) == ("get PyTorchJob ml/other: not found (never submitted, cancelled, or "
                              "removed after finishing)")


def test_status_report_reads_the_newest_progress_record_from_rank_0s_log_tail():
    """`ddpkit status`: the state from the workload, the record from the end of rank 0's pod
    log (asked for with tail_lines, never the whole log), the wait from PodScheduled."""
    cluster = FakeCluster(logs={"demo-0": [
        'ddpkit-progress {"state": "running", "step": 3, "total_steps": 9}\n',
        'some output\nddpkit-progress {"state": "running", "step": 6, "total_steps": 9}\n']})
    sub.submit(job(), flavor="job", cluster=cluster)
    cluster.objects[("Job", "ml", "demo")]["status"] = {"active": 2, "ready": 2}
    rank0 = pod("demo-0", "2026-01-01T00:00:00Z", **{COMPLETION_INDEX_KEY: "0"})
    rank0["status"] = {"conditions": [{"type": "PodScheduled", "status": "True",
                                       "lastTransitionTime": "2026-01-01T00:00:42Z"}]}
    cluster._pods = [rank0, pod("demo-1", **{COMPLETION_INDEX_KEY: "1"})]
    report = sub.report("k8s://ml/job/demo", cluster=cluster)
    assert report.state == "RUNNING" and report.record["step"] == 6 and report.waited_s == 42.0
    assert ("log", "demo-0", "trainer", False) in cluster.calls
    cluster._logs = {}
    assert sub.report("k8s://ml/job/demo", cluster=cluster).record is None  # a script: job


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 "
                            "nodes are available: 2 No preemption victims found for incoming pod."}


def test_status_says_what_holds_pods_up_in_the_schedulers_and_kubelets_words():
    """A job none of whose pods fit says why; one that is partly placed says how many are
    held up (the state the controller reports stays first); an image that cannot be pulled is
    named; a finished job is its state alone."""
    cluster = FakeCluster()
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)
    handle = "k8s://ml/pytorchjob/demo"
    master = pod("demo-master-0", **{PYTORCHJOB_REPLICA_TYPE: "master", PYTORCHJOB_REPLICA_INDEX: "0"})
    worker = pod("demo-worker-0", **{PYTORCHJOB_REPLICA_TYPE: "worker", PYTORCHJOB_REPLICA_INDEX: "0"})
    cluster._pods = [{**master, "status": {"conditions": [UNSCHEDULABLE]}},
                     {**worker, "status": {"conditions": [UNSCHEDULABLE]}}]
    assert sub.describe(handle, cluster=cluster) == (
        "PENDING (not scheduled: Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu.)")
    cluster.objects[("PyTorchJob", "ml", "demo")]["status"] = {"conditions": [{"type": "Running", "status": "True"}]}
    cluster._pods[0] = {**master, "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
    assert sub.describe(handle, cluster=cluster).startswith("RUNNING (1 of 2 pods not scheduled: Unschedulable: 0/2")
    pulling = {"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff",
                                                            "message": 'Back-off pulling image "nope:1"'}}}]}
    cluster._pods[1] = {**worker, "status": pulling}
    assert sub.describe(handle, cluster=cluster) == (
        'RUNNING (1 of 2 pods waiting: ImagePullBackOff: Back-off pulling image "nope:1")')
    cluster.objects[("PyTorchJob", "ml", "demo")]["status"] = {"conditions": [{"type": "Succeeded", "status": "True"}]}
    assert sub.describe(handle, cluster=cluster) == "SUCCEEDED"


#: a worker pod's conditions as the testbed's control plane left them after its node was killed
#: (kill-node; recorded from the real cluster): Ready False from the node lifecycle controller,
#: then DisruptionTarget from the taint-eviction controller
LOST_NODE_READY = {"type": "Ready", "status": "False", "lastTransitionTime": "2026-12-02T13:17:40Z"}
LOST_NODE_EVICTED = {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
                     "message": "Taint manager: deleting due to NoExecute taint"}


def test_status_names_the_node_that_stopped_answering():
    cluster = FakeCluster()
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)
    handle = "k8s://ml/pytorchjob/demo"
    cluster.objects[("PyTorchJob", "ml", "demo")]["status"] = {"conditions": [{"type": "Running", "status": "True"}]}
    master = pod("demo-master-0", **{PYTORCHJOB_REPLICA_TYPE: "master", PYTORCHJOB_REPLICA_INDEX: "0"})
    worker = pod("demo-worker-0", **{PYTORCHJOB_REPLICA_TYPE: "worker", PYTORCHJOB_REPLICA_INDEX: "0"})
    ready = [{"type": t, "status": "True"} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
    lost = [c for c in ready if c["type"] != "Ready"] + [LOST_NODE_READY]
    cluster._pods = [{**master, "spec": {"nodeName": "n0"}, "status": {"phase": "Running", "conditions": ready}},
                     {**worker, "spec": {"nodeName": "n1"}, "status": {"phase": "Running", "conditions": lost}}]
    line = sub.describe(handle, cluster=cluster)
    assert line.startswith("RUNNING (1 of 2 pods on lost node n1: NotReady"), line
    cluster._pods[1]["status"]["conditions"].append(LOST_NODE_EVICTED)
    line = sub.describe(handle, cluster=cluster)
    assert line.startswith("RUNNING (1 of 2 pods on lost node n1: NotReady, the pod evicted (DeletionByTaintManager)"), line
    assert "out-of-service" in line
    from deploy.why import state_cause

    assert state_cause(line).category == "node-lost"
    # restarts: 0 (or used up): the job fails; the pod stays Terminating on the dead node
    cluster.objects[("PyTorchJob", "ml", "demo")]["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    line = sub.describe(handle, cluster=cluster)
    assert line == ("FAILED (node rank 1 on lost node n1: NotReady, the pod evicted (DeletionByTaintManager))"), line
    cause = state_cause(line)
    assert cause.category == "node-lost" and cause.evidence.endswith("(DeletionByTaintManager)"), cause
    cluster._pods.pop()  # the node deleted or tainted out of service: the pod is gone, and with it the node
    assert sub.describe(handle, cluster=cluster) == "FAILED"


def test_a_watcher_keeps_the_jobs_pods_off_a_node_lost_under_it_until_the_job_ends():
    """k8s.avoid_lost_nodes (deploy/k8s/blame.py): the rendered pods ask for nodes without the
    job's avoid label; a watcher's refresh labels the node of a lost pod once, and takes the
    label off when the job has ended or is cancelled; a cluster that refuses says so."""
    from deploy.k8s import blame
    from deploy.k8s.render import render_objects

    key = "avoid.ddpkit.io/demo"
    for flavor in ("job", "pytorchjob", "jobset", "trainjob"):
        text = yaml.safe_dump(render_objects(job(), flavor=flavor))
        assert f"key: {key}\n" in text and "operator: DoesNotExist" in text, flavor
    off = job(k8s={"namespace": "ml", "avoid_lost_nodes": False})
    assert key not in yaml.safe_dump(render_objects(off, flavor="job"))

    cluster = FakeCluster()
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)
    handle = "k8s://ml/pytorchjob/demo"
    ready = [{"type": t, "status": "True"} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
    lost = [c for c in ready if c["type"] != "Ready"] + [LOST_NODE_READY]
    cluster._pods = [{"metadata": {"name": "demo-master-0"}, "spec": {"nodeName": "n0"}, "status": {"phase": "Running", "conditions": ready}},
                     {"metadata": {"name": "demo-worker-0"}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running", "conditions": lost}}]
    cluster.node_labels = {"n0": {}, "n1": {}, "n2": {}}
    assert blame.tend(handle, False, cluster=cluster) == [
        f"{handle}: node n1 was lost under the job: its pods stay off it (label {key}=lost)"]
    assert cluster.node_labels == {"n0": {}, "n1": {key: "lost"}, "n2": {}}
    assert blame.tend(handle, False, cluster=cluster) == []  # once
    assert blame.tend(handle, True, cluster=cluster) == [f"{handle}: node n1 may take the job's pods again (label {key} removed)"]
    assert cluster.node_labels["n1"] == {}
    blame.avoid_lost_nodes(handle, cluster=cluster)
    sub.cancel(handle, cluster=cluster, wait_s=0)
    assert cluster.node_labels["n1"] == {}
    cluster.errors[("label_node", "Node")] = seam.ApiError(403, "Forbidden", "nodes is forbidden")
    [line] = blame.tend(handle, False, cluster=cluster)
    assert "cannot label node" in line and "403 Forbidden" in line and "patch nodes" in line, line


def test_cancel_deletes_the_workload_then_its_configmap_and_service():
    cluster = FakeCluster()
    sub.submit(job(), flavor="job", cluster=cluster)
    sub.cancel("k8s://ml/job/demo", cluster=cluster)
    assert [c for c in cluster.calls if c[0] == "delete"] == [
        ("delete", "Job", "demo"), ("delete", "ConfigMap", "demo-job"), ("delete", "Service", "demo")]
    assert cluster.objects == {}
    with pytest.raises(RuntimeFailure, match="delete Job ml/demo: not found"):
        sub.cancel("k8s://ml/job/demo", cluster=cluster)


class TerminatingCluster(FakeCluster):
    """A foreground deletion: the workload stays readable for `lingers` more gets."""

    def __init__(self, lingers):
        super().__init__()
        self.lingers, self.deleted = lingers, {}

    def delete(self, kind, namespace, name, propagation="Foreground"):
        obj = self.objects.get((kind, namespace, name))
        super().delete(kind, namespace, name, propagation)
        self.deleted[(kind, namespace, name)] = obj

    def get(self, kind, namespace, name):
        key = (kind, namespace, name)
        if key in self.deleted and self.lingers > 0:
            self.lingers -= 1
            self.calls.append(("get", kind, name))
            return self.deleted[key]
        return super().get(kind, namespace, name)


def test_cancel_waits_until_the_workload_is_gone_as_kubectl_delete_does():
    cluster = TerminatingCluster(lingers=3)
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)
    sub.cancel("k8s://ml/pytorchjob/demo", cluster=cluster, poll_s=0)
    gets_after = [c for c in cluster.calls[cluster.calls.index(("delete", "PyTorchJob", "demo")):]
                  if c[0] == "get"]
    assert gets_after == [("get", "PyTorchJob", "demo")] * 4  # 3 while terminating, then 404
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)  # the name is free at once


def test_cancel_that_outlasts_its_wait_says_so_and_how_not_to_wait():
    cluster = TerminatingCluster(lingers=10**6)
    sub.submit(job(), flavor="job", cluster=cluster)
    with pytest.raises(RuntimeFailure) as err:
        sub.cancel("k8s://ml/job/demo", cluster=cluster, wait_s=0.05, poll_s=0.01)
    assert str(err.value) == ("Job ml/demo is deleted but still there 0 s later (Job demo; "
                              "kubectl get pods -n ml); `ddpkit cancel --wait 0` returns without waiting")
    cluster = TerminatingCluster(lingers=10**6)
    sub.submit(job(), flavor="job", cluster=cluster)
    before = len(cluster.calls)
    sub.cancel("k8s://ml/job/demo", cluster=cluster, wait_s=0)
    # no get: it did not wait (`nodes`: the nodes that k8s.avoid_lost_nodes kept off, none)
    assert [c[0] for c in cluster.calls[before:]] == ["delete"] * 3 + ["nodes"]


class TrainerCluster(FakeCluster):
    """Trainer's controller: the TrainJob made a JobSet of its name, which the garbage collector
    removes `jobset_lingers` gets after the TrainJob went; the pods `pods_linger` lists later."""

    def __init__(self, jobset_lingers, pods_linger):
        super().__init__(pods=[{"metadata": {"name": "demo-node-0-0-x"}}])
        self.jobset_lingers, self.pods_linger = jobset_lingers, pods_linger

    def get(self, kind, namespace, name):
        if kind == "JobSet" and ("TrainJob", namespace, name) not in self.objects:
            self.calls.append(("get", kind, name))
            if self.jobset_lingers > 0:
                self.jobset_lingers -= 1
                return {"kind": "JobSet", "metadata": {"name": name}}
            raise seam.ApiError(404, "NotFound", f"{name} not found")
        return super().get(kind, namespace, name)

    def pods(self, namespace, selector):
        pods = super().pods(namespace, selector)
        if ("TrainJob", namespace, "demo") in self.objects:
            return pods
        self.pods_linger -= 1
        return pods if self.pods_linger >= 0 else []


def test_a_trainjob_is_deleted_in_the_background_and_cancel_waits_out_its_jobset_and_pods():
    """Trainer v2.3's reconciler applies the JobSet again while a TrainJob is being deleted, so a
    foreground deletion can wait forever (a fresh cluster's garbage collector, slower than the
    controller: tests/test_k8s_conformance.py's trainjob case did); in the background the
    TrainJob goes at once and `cancel` waits until its JobSet and pods are gone too."""
    cluster = TrainerCluster(jobset_lingers=2, pods_linger=4)
    sub.submit(job(), flavor="trainjob", cluster=cluster)
    sub.cancel("k8s://ml/trainjob/demo", cluster=cluster, poll_s=0)
    assert cluster.propagation == {"TrainJob": "Background", "ConfigMap": "Foreground"}
    assert cluster.jobset_lingers == 0 and cluster.pods_linger == -1  # both waited out
    for flavor in ("job", "jobset", "pytorchjob"):
        other = FakeCluster()
        sub.submit(job(), flavor=flavor, cluster=other)
        sub.cancel(f"k8s://ml/{flavor}/demo", cluster=other, poll_s=0)
        assert other.propagation[FLAVOR_KIND[flavor]] == "Foreground"
    cluster = TrainerCluster(jobset_lingers=10**6, pods_linger=10**6)
    sub.submit(job(), flavor="trainjob", cluster=cluster)
    with pytest.raises(RuntimeFailure, match=r"^TrainJob ml/demo is deleted but still there 0 s later "
                       r"\(JobSet demo, pod demo-node-0-0-x; kubectl get pods -n ml\)"):
        sub.cancel("k8s://ml/trainjob/demo", cluster=cluster, wait_s=0.05, poll_s=0.01)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_flavor_submits_through_known_kinds_and_cancel_removes_all_of_it(flavor):
    """The API versions status/cancel use and cancel's list of objects match what the
    renderer makes, for every flavor."""
    cluster = FakeCluster()
    sub.submit(job(), flavor=flavor, cluster=cluster)
    for (kind, _, _), obj in cluster.objects.items():
        assert obj["apiVersion"] == seam.API_VERSIONS[kind]
        module = flavor_of_kind(kind)
        assert module is None or module.NAME == flavor
    assert sub.status(f"k8s://ml/{flavor}/demo", cluster=cluster) == "PENDING"
    sub.cancel(f"k8s://ml/{flavor}/demo", cluster=cluster)
    assert cluster.objects == {}

@pytest.mark.parametrize(("flavor", "nodes"), [(f, 3) for f in FLAVORS] + [("pytorchjob", "2:3")])
def test_node_rank_of_every_pod_the_controllers_make_is_its_rank(flavor, nodes):
    """`ddpkit logs --rank` reads ranks from pod labels and annotations as the controllers set
    them (the emulation `--docker` runs) and finds each node's pod."""
    from deploy.k8s.render import render_objects
    from deploy.run.docker import controller_pods

    made = controller_pods(render_objects(job(nodes=nodes), flavor=flavor))
    listed = [{"metadata": {"name": p.name, "labels": p.labels, "annotations": p.annotations}}
              for p in made]
    ranks = sub.pods_by_rank(flavor, listed)
    assert {r: p["metadata"]["name"] for r, p in ranks.items()} == {p.index: p.name for p in made}
    assert sorted(ranks) == list(range(len(made)))

def pod(name, stamp="2026-01-01T00:00:00Z", **labels):
    return {"metadata": {"name": name, "creationTimestamp": stamp, "labels": labels}}


def test_logs_pick_the_newest_pod_of_the_rank_and_the_training_container():
    pods = [
        pod("demo-master-0", **{PYTORCHJOB_REPLICA_TYPE: "master", PYTORCHJOB_REPLICA_INDEX: "0"}),
        pod("demo-worker-0", **{PYTORCHJOB_REPLICA_TYPE: "worker", PYTORCHJOB_REPLICA_INDEX: "0"}),
    ]
    cluster = FakeCluster(pods=pods, logs={"demo-worker-0": ["step 1\n", "step 2\n"]})
    out = io.StringIO()
    assert sub.logs("k8s://ml/pytorchjob/demo", rank=1, cluster=cluster, out=out) == 0
    assert out.getvalue() == "step 1\nstep 2\n"
    assert ("log", "demo-worker-0", "pytorch", False) in cluster.calls
    assert ("pods", "app.kubernetes.io/instance=demo,app.kubernetes.io/managed-by=ddpkit") in cluster.calls


def test_logs_for_indexed_pods_use_the_completion_index_and_follow():
    idx = COMPLETION_INDEX_KEY
    pods = [pod("demo-1-old", "2026-01-01T00:00:00Z", **{idx: "1"}),
            pod("demo-1-new", "2026-01-01T00:05:00Z", **{idx: "1"}),
            pod("demo-0", **{idx: "0"})]
    cluster = FakeCluster(pods=pods, logs={"demo-1-new": ["hi\n"]})
    out = io.StringIO()
    sub.logs("k8s://ml/job/demo", rank=1, follow=True, cluster=cluster, out=out)
    assert out.getvalue() == "hi\n" and ("log", "demo-1-new", "trainer", True) in cluster.calls


def two_pods_two_processes_each():
    idx = COMPLETION_INDEX_KEY
    env = {"spec": {"containers": [{"name": "trainer", "env": [{"name": "DDPKIT_NPROC_PER_NODE", "value": "2"}]}]}}
    pods = [{**pod("demo-0", **{idx: "0"}), **env}, {**pod("demo-1", **{idx: "1"}), **env}]
    # chunks as the API server streams them: cut anywhere, lines split across chunks
    logs = {"demo-0": ["ddpkit launch: node rank 0\n10:00 ddpkit rank 0 INFO step 1\nddpkit-summ",
                       'ary {"x": 1}\n'],
            "demo-1": ["ddpkit launch: node rank 1\n10:00 ddpkit rank 2 INFO a\n[ran", "k3]: boom\n10:01 ddpkit ra",
                       "nk 3 WARNING b\n10:02 ddpkit rank 2 INFO c"]}
    return FakeCluster(pods=pods, logs=logs)


@pytest.mark.parametrize("query,expected", [
    # --rank is the node (a pod), --worker-rank R the process: the pod of node R // nproc, the
    # lines that name R (torch's [rankR]:, the trainer's `ddpkit rank R`)
    (Query(worker_rank=3), "[rank3]: boom\n10:01 ddpkit rank 3 WARNING b\n"),
    (Query(worker_rank=2), "10:00 ddpkit rank 2 INFO a\n10:02 ddpkit rank 2 INFO c"),
    (Query(rank=1), "ddpkit launch: node rank 1\n10:00 ddpkit rank 2 INFO a\n[rank3]: boom\n"
                    "10:01 ddpkit rank 3 WARNING b\n10:02 ddpkit rank 2 INFO c"),
    # every pod, node order, each line tagged as trainer.launch tags a Slurm node's lines
    (Query(every=True), '[0/-] ddpkit launch: node rank 0\n[0/0] 10:00 ddpkit rank 0 INFO step 1\n'
                        '[0/-] ddpkit-summary {"x": 1}\n[1/-] ddpkit launch: node rank 1\n'
                        '[1/2] 10:00 ddpkit rank 2 INFO a\n[1/3] [rank3]: boom\n[1/3] 10:01 ddpkit rank 3 WARNING b\n'
                        '[1/2] 10:02 ddpkit rank 2 INFO c'),
    (Query(every=True, grep="WARN|boom"), "[1/3] [rank3]: boom\n[1/3] 10:01 ddpkit rank 3 WARNING b\n"),
])
def test_logs_rank_is_a_pod_worker_rank_a_process_all_every_pod(query, expected):
    out = io.StringIO()
    sub.logs("k8s://ml/job/demo", query=query, cluster=two_pods_two_processes_each(), out=out)
    assert out.getvalue() == expected


def test_logs_previous_reads_the_container_before_the_restart():
    cluster = two_pods_two_processes_each()
    cluster._logs["demo-1 previous"] = ["10:00 ddpkit rank 3 ERROR boom\n", "[rank3]: Traceback\n"]
    out = io.StringIO()
    sub.logs("k8s://ml/job/demo", query=Query(worker_rank=3, previous=True), follow=True, cluster=cluster, out=out)
    assert out.getvalue() == "10:00 ddpkit rank 3 ERROR boom\n[rank3]: Traceback\n"
    assert ("log", "demo-1", "trainer", False, "previous") in cluster.calls  # an ended container
    with pytest.raises(UserError, match=r"--attempt: Kubernetes keeps .* \(--previous\)"):
        sub.logs("k8s://ml/job/demo", query=Query(attempt=1), cluster=cluster)


def test_logs_all_with_follow_reads_every_pod_at_once():
    cluster = two_pods_two_processes_each()
    out = io.StringIO()
    sub.logs("k8s://ml/job/demo", query=Query(every=True), follow=True, cluster=cluster, out=out)
    assert sorted(out.getvalue().splitlines()) == sorted(
        sub_line for sub_line in (
            "[0/-] ddpkit launch: node rank 0", "[0/0] 10:00 ddpkit rank 0 INFO step 1", '[0/-] ddpkit-summary {"x": 1}',
            "[1/-] ddpkit launch: node rank 1", "[1/2] 10:00 ddpkit rank 2 INFO a", "[1/3] [rank3]: boom",
            "[1/3] 10:01 ddpkit rank 3 WARNING b", "[1/2] 10:02 ddpkit rank 2 INFO c"))
    assert {c for c in cluster.calls if c[0] == "log"} == {("log", "demo-0", "trainer", True),
                                                            ("log", "demo-1", "trainer", True)}
    with pytest.raises(RuntimeFailure, match=r"no pod for worker rank 5 \(node rank 2\)"):
        sub.logs("k8s://ml/job/demo", query=Query(worker_rank=5), cluster=cluster, out=io.StringIO())


def test_logs_for_a_rank_without_a_pod_says_which_ranks_exist():
    cluster = FakeCluster(pods=[pod("demo-0", **{COMPLETION_INDEX_KEY: "0"})])
    with pytest.raises(RuntimeFailure, match=r"no pod for node rank 3 \(ranks with pods: 0\)"):
        sub.logs("k8s://ml/jobset/demo", rank=3, cluster=cluster)


def test_elastic_pytorchjob_worker_index_is_the_rank():
    pods = [pod("demo-worker-0", **{PYTORCHJOB_REPLICA_TYPE: "worker", PYTORCHJOB_REPLICA_INDEX: "0"}),
            pod("demo-worker-1", **{PYTORCHJOB_REPLICA_TYPE: "worker", PYTORCHJOB_REPLICA_INDEX: "1"})]
    assert sorted(sub.pods_by_rank("pytorchjob", pods)) == [0, 1]


def test_submit_module_does_not_import_kubernetes_until_a_real_cluster_is_needed():
    import subprocess
    import sys

    code = ("import sys, deploy.k8s.submit, deploy.k8s.render, deploy.lint; "
            "print('kubernetes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the real client against a local HTTP stand-in for kube-apiserver -------------------------

def _resources(group_version, *resources):
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
            "resources": [{"name": plural, "singularName": plural[:-1], "namespaced": True,
                           "kind": kind, "verbs": ["create", "delete", "get", "list", "patch"]}
                          for plural, kind in resources]}


#: What the stand-in serves for discovery: core v1 and batch/v1, no custom resources.
DISCOVERY = {
    "/version": {"major": "1", "minor": "34", "gitVersion": "v1.34.10"},
    "/api": {"kind": "APIVersions", "versions": ["v1"]},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": "batch", "versions": [{"groupVersion": "batch/v1", "version": "v1"}],
         "preferredVersion": {"groupVersion": "batch/v1", "version": "v1"}}]},
    "/api/v1": _resources("v1", ("configmaps", "ConfigMap"), ("services", "Service"), ("pods", "Pod")),
    "/apis/batch/v1": _resources("batch/v1", ("jobs", "Job")),
}


class _ApiStandIn:
    """Answers the few REST calls ddpkit makes; records method, path and query of each."""

    def __init__(self):
        import http.server
        import threading

        self.requests: list[tuple[str, str, dict, dict | None]] = []
        self.content_types: list[str] = []
        self.store: dict[str, dict] = {}
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, body, content_type="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self):
                from urllib.parse import parse_qs, urlsplit

                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                stand_in.requests.append((self.command, parts.path, query, body))
                return parts.path, query, body

            def do_GET(self):
                path, query, _ = self._record()
                if path in DISCOVERY:
                    return self._reply(200, DISCOVERY[path])
                if path.endswith("/log"):
                    return self._reply(200, "line 1\nline 2\n", "text/plain")
                if path.endswith("/pods"):  # the workload's pod, while the workload is there
                    workload = any(p.split("/")[-2] not in ("configmaps", "services") for p in stand_in.store)
                    return self._reply(200, {"kind": "PodList", "apiVersion": "v1", "items": [
                        {"metadata": {"name": "demo-0", "annotations": {
                            "batch.kubernetes.io/job-completion-index": "0"}}}] if workload else []})
                if path in stand_in.store:
                    obj = dict(stand_in.store[path])
                    obj["status"] = {"active": 2, "ready": 2}
                    return self._reply(200, obj)
                self._reply(404, {"kind": "Status", "status": "Failure", "reason": "NotFound",
                                  "message": "not found", "code": 404})

            def do_PATCH(self):
                """Server-side apply (application/apply-patch+yaml; the body is JSON)."""
                path, query, body = self._record()
                stand_in.content_types.append(self.headers.get("Content-Type"))
                body["metadata"]["uid"] = f"uid-{body['metadata']['name']}"
                if query.get("dryRun") != "All":
                    stand_in.store[path] = body
                self._reply(200, body)

            def do_DELETE(self):
                path, _, _ = self._record()
                stand_in.store.pop(path, None)
                self._reply(200, {"kind": "Status", "status": "Success"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path):
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": self.url}}],
            "users": [{"name": "t", "user": {"token": "x"}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
        return path


@pytest.fixture
def api(tmp_path, monkeypatch):
    stand_in = _ApiStandIn()
    monkeypatch.setenv("KUBECONFIG", str(stand_in.kubeconfig(tmp_path / "kubeconfig")))
    yield stand_in
    stand_in.server.shutdown()


def _calls(api):
    """The requests that are not discovery."""
    return [(m, p, q, b) for m, p, q, b in api.requests if p not in DISCOVERY]


def test_real_client_server_side_applies_strictly_with_field_manager_ddpkit(api):
    out = sub.submit(job(), flavor="job", dry_run=True, cluster=seam.KubeCluster())
    assert out.startswith("k8s://ml/job/demo")
    assert [(m, p) for m, p, _, _ in _calls(api)] == [
        ("GET", "/apis/batch/v1/namespaces/ml/jobs/demo"),  # not there yet: 404
        ("PATCH", "/api/v1/namespaces/ml/configmaps/demo-job"),
        ("PATCH", "/api/v1/namespaces/ml/services/demo"),
        ("PATCH", "/apis/batch/v1/namespaces/ml/jobs/demo")]
    assert all(q == {"dryRun": "All", "fieldValidation": "Strict", "fieldManager": "ddpkit"}
               for m, _, q, _ in _calls(api) if m == "PATCH")
    assert set(api.content_types) == {"application/apply-patch+yaml"}


def test_real_client_status_logs_and_foreground_cancel(api):
    cluster = seam.KubeCluster()
    sub.submit(job(), flavor="job", cluster=cluster)
    assert sub.status("k8s://ml/job/demo", cluster=cluster) == "RUNNING"
    out = io.StringIO()
    sub.logs("k8s://ml/job/demo", rank=0, cluster=cluster, out=out)
    assert out.getvalue() == "line 1\nline 2\n"
    log_call = next(r for r in api.requests if r[1].endswith("/log"))
    assert log_call[1] == "/api/v1/namespaces/ml/pods/demo-0/log" and log_call[2]["container"] == "trainer"
    sub.cancel("k8s://ml/job/demo", cluster=cluster)
    deletes = [(p, b) for m, p, _, b in api.requests if m == "DELETE"]
    assert deletes[0] == ("/apis/batch/v1/namespaces/ml/jobs/demo", {"propagationPolicy": "Foreground"})
    assert [p for p, _ in deletes[1:]] == ["/api/v1/namespaces/ml/configmaps/demo-job",
                                           "/api/v1/namespaces/ml/services/demo"]
    after = api.requests[max(i for i, r in enumerate(api.requests) if r[0] == "DELETE"):]
    assert ("GET", "/api/v1/namespaces/ml/pods") in [(m, p) for m, p, _, _ in after]  # waited for them


def test_real_client_reads_pods_nodes_and_logs_without_the_typed_core_api(api):
    """Status, logs and the nodes' labels go through the dynamic client: the typed CoreV1Api and
    its pydantic models (about 0.9 CPU-seconds to import with kubernetes 37) are never loaded."""
    api.store["/apis/batch/v1/namespaces/ml/jobs/demo"] = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "demo", "namespace": "ml"}}
    probe = ("import io, sys\n"
             "from deploy.k8s import cluster as seam, submit as sub\n"
             "cluster = seam.KubeCluster()\n"
             "print(sub.status('k8s://ml/job/demo', cluster=cluster))\n"
             "print([p['metadata']['name'] for p in cluster.pods('ml', 'x=y')])\n"
             "print(''.join(cluster.log('ml', 'demo-0', 'trainer', False, tail_lines=5)), end='')\n"
             "print(sorted(m for m in sys.modules if m.startswith(('kubernetes.client.api.', "
             "'kubernetes.client.models.'))))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.stdout.splitlines() == ["RUNNING", "['demo-0']", "line 1", "line 2", "[]"], \
        result.stdout + result.stderr
    log_call = next(q for m, p, q, _ in api.requests if p.endswith("/log"))
    assert log_call == {"container": "trainer", "follow": "false", "tailLines": "5"}


def test_real_client_missing_crd_rolls_back(api):
    with pytest.raises(RuntimeFailure, match="does not serve PyTorchJob"):
        sub.submit(job(), flavor="pytorchjob", cluster=seam.KubeCluster())
    assert [(m, p) for m, p, _, _ in _calls(api)][-1] == (
        "DELETE", "/api/v1/namespaces/ml/configmaps/demo-job")


def test_cli_without_credentials_is_one_line(tmp_path):
    from tests.conftest import ddpkit

    result = ddpkit("status", "k8s://ml/job/demo",
                    env={"KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr == ("error: no Kubernetes credentials: set KUBECONFIG (or ~/.kube/config) "
                             "or run inside a cluster\n")


def test_a_kubeconfig_that_cannot_be_used_is_named_with_the_client_s_reason(tmp_path):
    """Not "no credentials": the kubeconfig is there, and what is wrong with it is said (here
    a current-context that the file does not define), so the user fixes the right thing."""
    from tests.conftest import ddpkit

    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    result = ddpkit("status", "k8s://ml/job/demo", env={"KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: kubeconfig {kubeconfig}: ")
    assert "gone" in result.stderr and "no Kubernetes credentials" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_submit_makes_the_workload_own_its_configmap_and_service():
    cluster = FakeCluster()
    sub.submit(job(), flavor="job", cluster=cluster)
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "demo", "uid": "uid-Job-demo"}
    for kind, name in (("ConfigMap", "demo-job"), ("Service", "demo")):
        assert cluster.objects[(kind, "ml", name)]["metadata"]["ownerReferences"] == [owner]


def test_dry_run_patches_nothing():
    cluster = FakeCluster()
    sub.submit(job(), flavor="jobset", dry_run=True, cluster=cluster)
    assert [c[0] for c in cluster.calls] == ["get", "apply", "apply"]


def test_cancel_after_the_workload_is_gone_still_removes_its_configmap():
    cluster = FakeCluster()
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)
    del cluster.objects[("PyTorchJob", "ml", "demo")]  # ttlSecondsAfterFinished, say
    sub.cancel("k8s://ml/pytorchjob/demo", cluster=cluster)
    assert cluster.objects == {}
    sub.submit(job(), flavor="pytorchjob", cluster=cluster)  # the name is free again


def test_real_client_applies_owner_references_as_the_same_manager(api):
    sub.submit(job(), flavor="job", cluster=seam.KubeCluster())
    applies = [(p, b) for m, p, _, b in _calls(api) if m == "PATCH"]
    assert [p for p, _ in applies] == [
        "/api/v1/namespaces/ml/configmaps/demo-job", "/api/v1/namespaces/ml/services/demo",
        "/apis/batch/v1/namespaces/ml/jobs/demo",
        "/api/v1/namespaces/ml/configmaps/demo-job", "/api/v1/namespaces/ml/services/demo"]
    again = applies[3][1]
    assert again["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert again["data"] == applies[0][1]["data"]  # the whole intent again, not a partial patch


#: a preempted job's Workload as the real Kueue 0.18.4 left it on the testbed while the job
#: waited to be readmitted (tests/test_k8s_kueue.py; recorded, UIDs shortened)
PREEMPTED_WORKLOAD_CONDITIONS = [
    {"type": "QuotaReserved", "status": "False", "reason": "Pending",
     "message": "couldn't assign flavors to pod set main: insufficient unused quota for cpu in flavor "
                "testbed, 800m more needed", "lastTransitionTime": "2026-12-02T17:40:09Z"},
    {"type": "Evicted", "status": "True", "reason": "Preempted",
     "message": "Preempted to accommodate a workload (UID: 6445cea7, JobUID: ac54834b) due to "
                "prioritization in the ClusterQueue; preemptor path: /ddpkit; preemptee path: /ddpkit",
     "lastTransitionTime": "2026-12-02T17:40:08Z"},
    {"type": "Requeued", "status": "True", "reason": "Preempted", "lastTransitionTime": "2026-12-02T17:40:08Z"},
]


def test_a_job_kueue_holds_is_queued_with_kueues_reasons_read_from_its_workload():
    """QUEUED before Kueue made the Workload, then in Kueue's words: why it was evicted (when
    it was) and why it is not admitted; the Workload is found by the job's UID label."""
    cluster = FakeCluster()
    sub.submit(job(k8s={"namespace": "ml", "queue": "team-a"}), flavor="job", cluster=cluster)
    stored = cluster.objects[("Job", "ml", "demo")]
    stored["spec"]["suspend"] = True  # what Kueue's webhook does at creation
    handle = "k8s://ml/job/demo"
    assert sub.describe(handle, cluster=cluster) == "QUEUED (in LocalQueue team-a: Kueue has not made its Workload yet)"
    uid = stored["metadata"]["uid"]
    workload = {"kind": "Workload", "metadata": {"name": "job-demo-1a2b3", "namespace": "ml",
                                                 "labels": {"kueue.x-k8s.io/job-uid": uid}},
                "status": {"conditions": PREEMPTED_WORKLOAD_CONDITIONS[:1]}}
    cluster.objects[("Workload", "ml", "job-demo-1a2b3")] = workload
    assert sub.describe(handle, cluster=cluster) == (
        "QUEUED (Pending: couldn't assign flavors to pod set main: insufficient unused quota for cpu in "
        "flavor testbed, 800m more needed)")
    workload["status"]["conditions"] = PREEMPTED_WORKLOAD_CONDITIONS
    line = sub.describe(handle, cluster=cluster)
    assert line.startswith("QUEUED (Preempted: Preempted to accommodate a workload (UID: 6445cea7"), line
    assert line.endswith("; Pending: couldn't assign flavors to pod set main: insufficient unused quota for cpu "
                         "in flavor testbed, 800m more needed)"), line
    from deploy.why import state_cause

    assert state_cause(line).category == "queued"
    stored["spec"]["suspend"] = False  # admitted
    stored["status"] = {"active": 2, "ready": 2}
    assert sub.describe(handle, cluster=cluster) == "RUNNING"


def test_why_reads_the_log_of_the_container_before_an_in_place_restart():
    """A PyTorchJob's container (restartPolicy OnFailure) that the watchdog ended is restarted
    in place by the kubelet: the verdict is in the previous container's log, not the running
    one's; `why` reads both, the previous first."""
    from trainer.watchdog import PREFIX

    labels = {PYTORCHJOB_REPLICA_TYPE: "master", PYTORCHJOB_REPLICA_INDEX: "0"}
    master = {**pod("demo-master-0", **labels), "spec": {"nodeName": "node-a"},
              "status": {"containerStatuses": [{
                  "name": "pytorch", "restartCount": 1, "state": {"running": {}},
                  "lastState": {"terminated": {"exitCode": 124, "reason": "Error"}}}]}}
    verdict = {"attempt": 0, "reporter": 0, "host": "demo-master-0", "cause": "stuck-outside-collective",
               "culprits": [1], "explain": "rank 1 on demo-master-0 in data at step 27 for 23s",
               "others": "rank 0 in backward at step 27", "debug_dir": "/out/debug/attempt-0"}
    cluster = FakeCluster(pods=[master], logs={
        "demo-master-0 previous": ["10:00 ddpkit rank 0 INFO step 27\n", PREFIX + json.dumps(verdict) + "\n"],
        "demo-master-0": ["10:01 ddpkit rank 0 INFO resumed from step 20\n"]})
    cluster.objects[("PyTorchJob", "ml", "demo")] = {
        "kind": "PyTorchJob", "metadata": {"name": "demo", "namespace": "ml"},
        "status": {"conditions": [{"type": "Running", "status": "True"}]}}
    lines = sub.why("k8s://ml/pytorchjob/demo", cluster=cluster)
    assert lines[0].startswith("hang: ") and "rank 1 on demo-master-0 in data" in lines[0], lines
    logs = [c for c in cluster.calls if c[0] == "log"]
    assert logs == [("log", "demo-master-0", "pytorch", False, "previous"), ("log", "demo-master-0", "pytorch", False)]


def test_why_finds_the_verdict_in_rank_0s_log_when_only_another_node_failed():
    """A plain Indexed Job with no restarts left: the watchdog's reporter (rank 0) posted its
    verdict too late for node 1's relay, node 1's pod failed first and the Job controller is
    deleting node 0's pod (still running). `why` reads the failed pod's log, then only the
    verdict line of rank 0's (its other lines would only echo the failure)."""
    from trainer.watchdog import PREFIX

    failed = {**pod("demo-1", **{COMPLETION_INDEX_KEY: "1"}), "spec": {"nodeName": "node-b"},
              "status": {"containerStatuses": [{"name": "trainer", "state": {
                  "terminated": {"exitCode": 1, "reason": "Error"}}}]}}
    rank0 = {**pod("demo-0", **{COMPLETION_INDEX_KEY: "0"}), "metadata": {
        **pod("demo-0")["metadata"], "labels": {COMPLETION_INDEX_KEY: "0"}, "deletionTimestamp": "2026-01-01T00:01:00Z"},
        "status": {"containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}}
    verdict = {"attempt": 0, "reporter": 0, "host": "demo-0", "cause": "stuck-outside-collective",
               "culprits": [1], "explain": "rank 1 on demo-1 in script at step 8 for 4s: loop.py:45 in main",
               "others": "rank 0 in collective at step 8", "debug_dir": "/out/debug/attempt-0"}
    cluster = FakeCluster(pods=[rank0, failed], logs={
        "demo-1": ["[W] torch.distributed.elastic ... failed\n", "exitcode  : 124\n"],
        "demo-0": ["RuntimeError: Connection closed by peer\n", PREFIX + json.dumps(verdict) + "\n"]})
    cluster.objects[("Job", "ml", "demo")] = {
        "kind": "Job", "metadata": {"name": "demo", "namespace": "ml"},
        "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}
    lines = sub.why("k8s://ml/job/demo", cluster=cluster)
    assert lines[0].startswith("hang: rank 1 on demo-1"), lines
    assert [c[1] for c in cluster.calls if c[0] == "log"] == ["demo-1", "demo-0"]
    assert not any("Connection closed" in line for line in lines), lines
