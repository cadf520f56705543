"""The flavor modules against the real controllers on the Kubernetes testbed.

1. Conformance of `run --docker`'s emulation (`deploy.k8s.<flavor>.pods`): for every flavor, the
   pods the real training-operator, JobSet, Trainer and Job controllers create for a rendered job
   are compared with the pods the emulation plans: hostname, subdomain, init containers, the
   training container's env (names, order and values: the kubelet's precedence is the order),
   and the labels and annotations the controllers set (the ones fieldRefs read). The pods only
   have to exist, not to run: the image need not be on the node.
2. The API server accepts every typed cluster field (issue 10 item 6): a job file using all of
   them is applied with `--dry-run=server` for every flavor (webhooks included).

Needs the testbed (`ddpkit testbed k8s up`, root); runs with CI=true or DDPKIT_K8S_E2E=1, like
tests/test_k8s_e2e.py, and leaves a testbed up that was up before.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time

import pytest
import yaml

from deploy.k8s import FLAVORS
from deploy.k8s import flavor as flavor_module
from deploy.k8s.render import render_k8s, render_objects
from deploy.load import parse_job
from deploy.run.docker import controller_pods
from tests.conftest import IN_CI, REPO, ddpkit, require

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Label/annotation prefixes the controllers own: every such key on a live pod must be planned.
CONTROLLER_PREFIXES = ("training.kubeflow.org/", "jobset.sigs.k8s.io/", "batch.kubernetes.io/",
                       "trainer.kubeflow.org/")
#: Keys whose values the emulation cannot know (UIDs of objects the cluster created).
UNKNOWABLE = {"jobset.sigs.k8s.io/jobset-uid", "batch.kubernetes.io/controller-uid", "controller-uid"}
#: What Trainer's TrainJobStatus plugin adds to the trainer containers where the cluster turned
#: its feature gate on (the testbed does): its status server's URL, CA and token, for
#: trainer/kubeflow_status.py. A cluster setting, not the TrainJob's: the emulation (`run
#: --docker`, which has no status server) leaves them out, and the comparison with it too.
STATUS_SERVER_ENV = {"KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_CA_CERT", "KUBEFLOW_TRAINER_SERVER_TOKEN"}


@pytest.fixture(scope="module")
def cluster():
    require(IN_CI or os.environ.get("DDPKIT_K8S_E2E") == "1",
            "real-Kubernetes tests run with CI=true or DDPKIT_K8S_E2E=1 (root: they start a cluster)")
    require(os.geteuid() == 0, "the Kubernetes testbed needs root (network, cgroups, daemons)")
    try:
        from deploy.testbed import k8s as testbed
    except ImportError:
        testbed = None
    require(testbed is not None, "the Kubernetes testbed (deploy/testbed/k8s.py) is not in this checkout")
    lock = open(f"{testbed.testbed_dir()}.lock", "w")
    take_lock(lock)
    was_up = testbed.status(quiet=True)
    if not was_up:
        testbed.up()
    env = testbed.client_env()
    env["PYTHONPATH"] = str(REPO)
    env["KUBECTL"] = testbed.kubectl()
    yield env
    if not was_up:
        testbed.down()
    lock.close()


def held_by_this_process(path: str) -> bool:
    """Whether this process already holds the flock on `path` (tests/test_k8s_e2e.py's session
    fixture, in the same pytest run): taking it again through another file would wait forever."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "FLOCK" in parts and len(parts) > 5 and parts[4] == str(os.getpid()) \
                    and parts[5].rsplit(":", 1)[-1] == str(inode):
                return True
    return False


def take_lock(lock) -> None:
    """The testbed's lock (sessions take turns), unless this run holds it already."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not held_by_this_process(lock.name):
            fcntl.flock(lock, fcntl.LOCK_EX)


def kubectl(cluster, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([cluster["KUBECTL"], *args], env=cluster, capture_output=True, text=True,
                          input=input, timeout=180)
    if check:
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc


def small_job(name: str, flavor: str, **fields) -> dict:
    """Two pods that only have to exist: the image is not on the node. imagePullPolicy Never
    keeps the kubelet from trying a registry (a TrainJob cannot set it: its pods just fail to
    pull, which is as good). A short grace period: a PyTorchJob Worker may still be in the
    operator's init container (a shell loop waiting for the master's DNS name, which ignores
    SIGTERM), and deleting it then takes the whole grace period (120 s by default: that made the
    first test of a fresh cluster fail in CI)."""
    pull = {} if flavor == "trainjob" else {"image_pull_policy": "Never"}
    return {"name": name, "image": "ddpkit:conformance", **pull, "nodes": 2, "procs_per_node": 2, "restarts": 1,
            "resources": {"cpus_per_node": 0.1, "memory": "256Mi", "shm": "64Mi"},
            "env": {"OMP_NUM_THREADS": "1"}, "checkpoint": {"ephemeral": True},
            "k8s": {"flavor": flavor, "termination_grace": 3}, **fields}


def cancel(cluster, flavor: str, name: str, timeout: float = 120) -> None:
    """`ddpkit cancel` (which waits for the workload, a TrainJob's JobSet and the pods), then
    check that the workload and its pods are gone:
    a submit of the same name while the old object is still terminating is refused ("already
    exists"), which is what made every test after a first run fail."""
    done = ddpkit("cancel", f"k8s://default/{flavor}/{name}", "--wait", str(timeout), env=cluster,
                  timeout=timeout + 30)
    assert done.returncode == 0 or "not found" in done.stderr, done.stderr  # nothing there: not found
    kind = flavor_module(flavor).KIND.lower()
    deadline = time.monotonic() + timeout
    while True:
        workload = kubectl(cluster, "get", kind, name, "-o", "name", check=False)
        left = kubectl(cluster, "get", "pods", "-l", f"app.kubernetes.io/instance={name}", "-o", "name",
                       check=False).stdout.split()
        if workload.returncode != 0 and "NotFound" in workload.stderr and not left:
            return
        assert time.monotonic() < deadline, f"{kind}/{name} still there {timeout}s after cancel: {left}"
        time.sleep(1)


def live_pods(cluster, name: str, count: int, timeout: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        out = kubectl(cluster, "get", "pods", "-l", f"app.kubernetes.io/instance={name}", "-o", "json")
        pods = json.loads(out.stdout)["items"]
        if len(pods) >= count:
            return pods
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: {len(pods)} of {count} pods after {timeout}s\n"
                        + kubectl(cluster, "get", "events", check=False).stdout[-3000:])
        time.sleep(1)


def env_list(container: dict) -> list[tuple]:
    return [(e["name"], e.get("value"), json.dumps(e.get("valueFrom"), sort_keys=True))
            for e in container.get("env") or []]


def training_container(spec: dict, name: str) -> dict:
    return next(c for c in spec["containers"] if c["name"] == name)


def pod_differences(where: str, got: dict, want, container: str) -> list[str]:
    """How a live pod differs from the planned one, one line per field."""
    spec, out = got["spec"], []

    def differ(field, have, planned):
        if have != planned:
            out.append(f"{where}: {field}: cluster {have!r}, emulation {planned!r}")

    differ("hostname", spec.get("hostname") or got["metadata"]["name"], want.hostname)
    differ("subdomain", spec.get("subdomain"), want.subdomain)
    differ("initContainers", [c["name"] for c in spec.get("initContainers") or []],
           [c["name"] for c in want.spec.get("initContainers") or []])
    differ(f"env of {container}", [e for e in env_list(training_container(spec, container))
                                    if e[0] not in STATUS_SERVER_ENV],
           env_list(training_container(want.spec, container)))
    for kind in ("labels", "annotations"):
        have = got["metadata"].get(kind) or {}
        planned = getattr(want, kind)
        for key, value in planned.items():
            if key not in UNKNOWABLE:
                differ(f"{kind}[{key}]", have.get(key), value)
        extra = {k for k in have if k.startswith(CONTROLLER_PREFIXES) and k not in planned
                 and k not in UNKNOWABLE}
        differ(f"{kind} the emulation does not plan", sorted(extra), [])
    return out


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_emulated_pods_are_the_pods_the_real_controllers_create(cluster, tmp_path, flavor):
    name = f"conf-{flavor}"
    job = parse_job(small_job(name, flavor))
    module = flavor_module(flavor)
    planned = controller_pods(render_objects(job, flavor=flavor))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_job(name, flavor)))
    cancel(cluster, flavor, name)  # a leftover of an earlier run
    submitted = ddpkit("submit", "k8s", str(path), env=cluster)
    assert submitted.returncode == 0, submitted.stderr
    try:
        live = live_pods(cluster, name, len(planned))
        by_rank = {module.node_rank(p, live): p for p in live}
        assert sorted(by_rank) == [p.index for p in planned]
        differences = []  # every difference of every pod, so one run shows them all
        for want in planned:
            got = by_rank[want.index]
            differences += pod_differences(f"{flavor} node {want.index} ({got['metadata']['name']})",
                                           got, want, module.CONTAINER)
        assert not differences, "\n".join(differences)
    finally:
        cancel(cluster, flavor, name)


def cluster_fields_job(flavor: str) -> dict:
    from tests.test_k8s_render import CLUSTER_FIELDS

    k8s = {**CLUSTER_FIELDS["k8s"], "flavor": flavor}
    if flavor == "trainjob":  # what Trainer v2.3's runtimePatches cannot say (refused offline)
        for field in ("host_network", "topology_spread", "init_containers", "sidecars"):
            k8s.pop(field)
        k8s["pod_patch"] = {"spec": {"containers": [{"name": "trainer", "env": [
            {"name": "NCCL_IB_HCA", "value": "mlx5"}]}]}}
    return {"name": f"fields-{flavor}", "image": "img:1", "nodes": 2, "checkpoint": {"ephemeral": True},
            **CLUSTER_FIELDS, "k8s": k8s}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_api_server_accepts_every_cluster_field(cluster, flavor):
    text = render_k8s(parse_job(cluster_fields_job(flavor)), flavor=flavor)
    proc = kubectl(cluster, "apply", "--dry-run=server", "--validate=strict", "-f", "-",
                   input=text, check=False)
    assert proc.returncode == 0, proc.stderr


def test_the_api_server_refuses_what_ddpkit_refuses_offline(cluster):
    """tolerationSeconds without NoExecute: refused by the job model (tests/test_refusals.py);
    here the same toleration, written into a pod by hand, is refused by the API server too."""
    text = render_k8s(parse_job({"name": "tol", "image": "img:1", "k8s": {"flavor": "job"}}), flavor="job")
    objects = [o for o in yaml.safe_load_all(text) if o]
    objects[-1]["spec"]["template"]["spec"]["tolerations"] = [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}]
    proc = kubectl(cluster, "apply", "--dry-run=server", "-f", "-",
                   input=yaml.safe_dump_all(objects), check=False)
    assert proc.returncode != 0 and "tolerationSeconds" in proc.stderr + proc.stdout


def test_submit_is_server_side_apply_with_field_manager_ddpkit(cluster, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_job("conf-ssa", "job")))
    cancel(cluster, "job", "conf-ssa")
    assert ddpkit("submit", "k8s", str(path), env=cluster).returncode == 0
    try:
        job = json.loads(kubectl(cluster, "get", "job", "conf-ssa", "-o", "json",
                                 "--show-managed-fields").stdout)
        managers = {(m["manager"], m["operation"]) for m in job["metadata"]["managedFields"]}
        assert ("ddpkit", "Apply") in managers
        again = ddpkit("submit", "k8s", str(path), env=cluster)
        assert again.returncode == 1 and "already exists; cancel it first" in again.stderr
        assert ddpkit("cancel", "k8s://default/job/conf-ssa", "--wait", "0", env=cluster).returncode == 0
        gone = kubectl(cluster, "get", "job", "conf-ssa", "-o", "json", check=False)
        # foreground deletion: the Job waits (deletionTimestamp + finalizer) until its pods are gone
        # (not waited for here, so that the finalizer can be seen)
        assert gone.returncode != 0 or "foregroundDeletion" in json.loads(gone.stdout)["metadata"].get(
            "finalizers", []), gone.stdout[-2000:]
    finally:
        cancel(cluster, "job", "conf-ssa")


# ---- beyond ddpkit's own manifests (issue 23): hand-written objects, applied as they are ----

ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"


def _pod(containers: list[dict], **spec) -> dict:
    return {"spec": {"template": {"spec": {"terminationGracePeriodSeconds": 3, "containers": containers, **spec}}}}


def _container(name: str, image: str = "ddpkit:conformance", **fields) -> dict:
    return {"name": name, "image": image, "imagePullPolicy": "Never", **fields}


def _runtime(name: str, ml_policy: dict, rjobs: list[dict]) -> dict:
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"mlPolicy": ml_policy, "template": {"spec": {"replicatedJobs": rjobs}}}}


def _trainjob(name: str, runtime: str, **spec) -> dict:
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"runtimeRef": {"name": runtime, "kind": "TrainingRuntime",
                                    "apiGroup": "trainer.kubeflow.org"}, **spec}}


def _applied(cluster, objects: list[dict]) -> None:
    """Apply the objects in order (a runtime before its TrainJob)."""
    _deleted(cluster, objects)  # a leftover of an earlier run
    for obj in objects:
        kubectl(cluster, "apply", "-f", "-", input=yaml.safe_dump(obj))


def _deleted(cluster, objects: list[dict], timeout: float = 120) -> None:
    """Delete the objects (the workload first) and wait until their pods are gone."""
    for obj in reversed(objects):
        kubectl(cluster, "delete", "--ignore-not-found", "--wait=true", "--timeout=120s", "-f", "-",
                input=yaml.safe_dump(obj), check=False)
    name = objects[-1]["metadata"]["name"]
    deadline = time.monotonic() + timeout
    while _jobset_pods(cluster, name):
        assert time.monotonic() < deadline, f"pods of {name} still there {timeout}s after delete"
        time.sleep(1)


def _jobset_pods(cluster, name: str) -> list[dict]:
    """The pods of the JobSet `name` (a TrainJob's JobSet has its name), by JobSet's own label."""
    out = kubectl(cluster, "get", "pods", "-l", f"jobset.sigs.k8s.io/jobset-name={name}", "-o", "json")
    return json.loads(out.stdout)["items"]


def _wait_pods(cluster, name: str, hostnames: set[str], timeout: float = 180) -> dict[str, dict]:
    """Live pods by hostname (an Indexed Job's pod sets spec.hostname), once all are there."""
    deadline = time.monotonic() + timeout
    while True:
        live = {p["spec"].get("hostname"): p for p in _jobset_pods(cluster, name)}
        if hostnames <= set(live):
            return live
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: pods {sorted(live)} of {sorted(hostnames)} after {timeout}s\n"
                        + kubectl(cluster, "get", "events", check=False).stdout[-3000:])
        time.sleep(1)


def _compare(cluster, objects: list[dict]) -> tuple[list, dict[str, dict], list[str]]:
    """(planned pods, live pods by hostname, differences) for objects already applied: every
    container's env, hostname, subdomain, labels and annotations, and the claim volumes."""
    planned = controller_pods(objects)
    name = objects[-1]["metadata"]["name"]
    live = _wait_pods(cluster, name, {p.hostname for p in planned})
    differences = []
    for want in planned:
        got = live[want.hostname]
        for c in want.spec["containers"]:
            differences += pod_differences(f"{want.name} ({got['metadata']['name']})", got, want, c["name"])
        claims = lambda spec: sorted((v["name"], v["persistentVolumeClaim"]["claimName"])  # noqa: E731
                                     for v in spec.get("volumes") or [] if "persistentVolumeClaim" in v)
        if claims(got["spec"]) != claims(want.spec):
            differences.append(f"{want.name}: claim volumes: cluster {claims(got['spec'])}, "
                               f"emulation {claims(want.spec)}")
    return planned, live, sorted(set(differences))


def test_trainjob_runtime_num_nodes_env_injection_and_cpu_nproc_are_trainers(cluster):
    """A CPU-only TrainingRuntime with mlPolicy.numNodes 2 and envInjection into a second
    container: the TrainJob sets neither numNodes nor numProcPerNode (PET_NNODES 2 from the
    runtime, PET_NPROC_PER_NODE 2 from the node container's CPU request)."""
    runtime = _runtime("conf-rt-env", {"numNodes": 2, "torch": {"envInjection": {"targets": [
        {"jobName": "node", "containerNames": ["probe"]}]}}}, [{
            "name": "node", "template": {"metadata": {"labels": {ANCESTOR: "trainer"}}, **_pod([
                _container("node", resources={"requests": {"cpu": "2"}}), _container("probe")])}}])
    objects = [runtime, _trainjob("conf-tj-env", "conf-rt-env", trainer={"env": [{"name": "A", "value": "1"}]})]
    _applied(cluster, objects)
    try:
        planned, _, differences = _compare(cluster, objects)
        assert len(planned) == 2
        assert not differences, "\n".join(differences)
    finally:
        _deleted(cluster, objects)


def test_jobset_coordinator_exclusive_topology_and_claims_are_jobsets(cluster):
    """Coordinator label/annotation, the exclusive-topology annotation (one pod per Job: every
    pod is a leader, so the pod webhook admits each at once) and a volumeClaimPolicies claim
    mounted by the pods (the PVC may stay Pending: the pods only have to exist)."""
    mount = [{"name": "cache", "mountPath": "/cache"}]
    js = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": {"name": "conf-js-coord", "namespace": "default",
                       "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "kubernetes.io/hostname"}},
          "spec": {"coordinator": {"replicatedJob": "w", "jobIndex": 1, "podIndex": 0},
                   "volumeClaimPolicies": [{"templates": [{"metadata": {"name": "cache"}, "spec": {
                       "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}}}]}],
                   "replicatedJobs": [{"name": "w", "replicas": 2, "template": {"spec": {
                       "parallelism": 1, "completions": 1, "backoffLimit": 0,
                       **_pod([_container("c", volumeMounts=mount)], restartPolicy="Never")["spec"]}}}]}}
    _applied(cluster, [js])
    try:
        planned, _, differences = _compare(cluster, [js])
        assert len(planned) == 2
        assert not differences, "\n".join(differences)
    finally:
        _deleted(cluster, [js])


def test_trainjob_initializer_job_runs_first_with_the_trainjobs_storage_uri(cluster):
    """A runtime with a dataset-initializer job that `node` dependsOn (Complete): Builder.Initializer
    sets the TrainJob's STORAGE_URI on it; its pod (the testbed's busybox, exit 0) completes,
    then the node pods appear. Before that, none may exist."""
    from deploy.testbed import k8s as testbed

    volume = [{"name": "initializer", "emptyDir": {}}]
    mount = [{"name": "initializer", "mountPath": "/workspace"}]
    init = {"name": "dataset-initializer", "template": {
        "metadata": {"labels": {ANCESTOR: "dataset-initializer"}}, **_pod([_container(
            "dataset-initializer", testbed.BUSYBOX_IMAGE, command=["sh", "-c", "sleep 5"], volumeMounts=mount)],
            volumes=volume, restartPolicy="Never")}}
    node = {"name": "node", "dependsOn": [{"name": "dataset-initializer", "status": "Complete"}],
            "template": {"metadata": {"labels": {ANCESTOR: "trainer"}}, **_pod(
                [_container("node", volumeMounts=mount, resources={"requests": {"cpu": "1"}})], volumes=volume)}}
    objects = [_runtime("conf-rt-init", {"numNodes": 1, "torch": {}}, [init, node]),
               _trainjob("conf-tj-init", "conf-rt-init", initializer={"dataset": {"storageUri": "hf://conf/data"}})]
    planned_all = controller_pods(objects)
    assert planned_all[0].depends_on == [("dataset-initializer", "Complete")]
    _applied(cluster, objects)
    try:
        first = _wait_pods(cluster, "conf-tj-init", {"conf-tj-init-dataset-initializer-0-0"})
        assert not any(p["spec"].get("hostname", "").startswith("conf-tj-init-node-") for p in first.values()), \
            "the node pods exist before the initializer completed"
        planned, _, differences = _compare(cluster, objects)
        assert {p.group for p in planned} == {"dataset-initializer", "node"}
        assert not differences, "\n".join(differences)
    finally:
        _deleted(cluster, objects)
