"""End to end on a real Kubernetes cluster (`ddpkit testbed k8s`, brought up here).

The cluster is built from upstream sources (k8s/testbed/build.sh) and runs as host processes:
etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet + containerd, CoreDNS,
and the real training-operator, JobSet and Trainer controllers with their webhooks. Every
check goes through the CLI (`ddpkit submit/status/logs/cancel`, `kubectl`) in a subprocess,
as a user would run it; the oracle is the cluster (its conditions, its pods, its webhooks).

Needs root, the Docker testbed (the training image is built offline there and loaded into the
cluster's containerd) and the binaries. Runs with CI=true (a missing prerequisite then fails)
or when asked for with DDPKIT_K8S_E2E=1; otherwise skips with the reason. Sessions take turns
through a lock file; a cluster that was up before the session is left up.

Jobs are quickstart-2node (2 pods x 2 processes) shrunk to fit a 2-core node: 0.7 CPU and
2 GiB per pod. Checkpoints and metrics go to a hostPath volume (the test's tmp dir), the
stand-in for a shared filesystem, so a replacement pod resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from deploy.testbed import k8s as testbed
from tests.conftest import K8S_TEST_IMAGE, REPO, ddpkit, k8s_report, require

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IMAGE = K8S_TEST_IMAGE  # built and loaded by the `image` fixture (tests/conftest.py: `cluster`, `image`, `handles`)
FLAVORS = ["pytorchjob", "trainjob", "jobset", "job"]
QUICK = REPO / "examples" / "quickstart-2node.yaml"
JOB_TIMEOUT_S = 600
#: the workload kind and the controller that owns the pods, per flavor
WORKLOAD = {"pytorchjob": "pytorchjob", "trainjob": "trainjob", "jobset": "jobset", "job": "job"}
POD_OWNER = {"pytorchjob": "PyTorchJob", "trainjob": "Job", "jobset": "Job", "job": "Job"}
INSTANCE = "app.kubernetes.io/instance"
# the labels and annotations the real controllers put on pods
PYTORCHJOB_REPLICA_TYPE = "training.kubeflow.org/replica-type"
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"


def kubectl(cluster, *args: str, input: str | None = None, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([testbed.kubectl(), *args], env=cluster, capture_output=True,
                          text=True, input=input, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc


def job_file(tmp_path: Path, name: str, flavor: str, **train) -> Path:
    """quickstart-2node under another name, with the test image, shrunk to the node, writing
    its run directory to a hostPath volume (tmp_path/out)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    os.chmod(out, 0o777)  # the image runs as uid 1000
    job = yaml.safe_load(QUICK.read_text())
    job.update(name=name, image=IMAGE,
               resources={"cpus_per_node": 0.7, "memory": "2Gi", "shm": "256Mi"},
               volumes=[{"name": "out", "mount": "/out", "host_path": str(out)}])
    job["train"].update(output_dir="/out", plot=False, **train)
    job["k8s"] = {"flavor": flavor, "one_pod_per_node": True}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def submit(cluster, handles, path: Path) -> str:
    proc = ddpkit("submit", "k8s", str(path), env=cluster)
    assert proc.returncode == 0, proc.stderr
    handle = proc.stdout.strip()
    assert handle.startswith("k8s://"), proc.stdout
    handles.append(handle)
    return handle


def status(cluster, handle: str) -> str:
    """The state: the first word of `ddpkit status` (progress follows it)."""
    return status_line(cluster, handle).split()[0]


def status_line(cluster, handle: str) -> str:
    proc = ddpkit("status", handle, env=cluster)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def wait_for(cluster, handle: str, wanted: set[str], timeout: float = JOB_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = k8s_report(cluster, handle).state
        if state in wanted:
            return state
        if state in ("FAILED", "CANCELLED") or time.monotonic() > deadline:
            pytest.fail(f"{handle} is {state}, expected {sorted(wanted)}\n{describe(cluster, handle)}")
        time.sleep(1)


def name_of(handle: str) -> str:
    return handle.rsplit("/", 1)[1]


def pods(cluster, name: str) -> list[dict]:
    out = kubectl(cluster, "get", "pods", "-l", f"{INSTANCE}={name}", "-o", "json")
    return json.loads(out.stdout)["items"]


def describe(cluster, handle: str) -> str:
    """What the cluster says about a job (for failure messages)."""
    flavor, name = handle.split("/")[-2:]
    parts = [kubectl(cluster, "get", WORKLOAD[flavor], name, "-o", "yaml", check=False).stdout[-3000:],
             kubectl(cluster, "get", "pods", "-o", "wide", check=False).stdout,
             kubectl(cluster, "get", "events", "--sort-by=.lastTimestamp", check=False).stdout[-3000:]]
    for pod in pods(cluster, name):
        parts.append(kubectl(cluster, "logs", pod["metadata"]["name"], "--all-containers",
                             "--tail=30", check=False).stdout)
    return "\n".join(parts)


def logs(cluster, handle: str, rank: int) -> str:
    proc = ddpkit("logs", handle, "--rank", str(rank), env=cluster)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def summaries(log: str) -> list[dict]:
    return [json.loads(line.split("ddpkit-summary ", 1)[1]) for line in log.splitlines()
            if "ddpkit-summary " in line]


def metric_steps(out: Path) -> list[int]:
    steps = []
    for path in out.glob("*/metrics.jsonl"):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if "loss" in record and "step" in record:
                steps.append(record["step"])
    return steps


def assert_trained_on_two_pods(summary: dict, pod_names: set[str]) -> None:
    assert summary["status"] == "completed", summary
    assert summary["world_size"] == 4
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1, 2, 3]
    assert len(summary["hostnames"]) == 2, summary["hostnames"]
    assert set(summary["hostnames"]) <= pod_names | {p.split(".")[0] for p in pod_names}, (
        summary["hostnames"], pod_names)
    assert summary["params_identical"] is True
    assert len({r["params_sha256"] for r in summary["ranks"]}) == 1
    assert summary["final_loss"] < summary["first_loss"], summary


def wait_no_leftovers(cluster, flavor: str, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = [p["metadata"]["name"] for p in pods(cluster, name)]
        workload = kubectl(cluster, "get", WORKLOAD[flavor], name, check=False)
        others = kubectl(cluster, "get", "configmaps,services,jobs,jobsets", "-l",
                         f"{INSTANCE}={name}", "-o", "name", check=False).stdout.split()
        if not left and workload.returncode != 0 and not others:
            assert "NotFound" in workload.stderr, workload.stderr
            return
        assert time.monotonic() < deadline, f"left after cancel: pods {left}, objects {others}"
        time.sleep(1)


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_flavor_trains_across_pods_and_cancel_leaves_nothing(cluster, image, handles, tmp_path,
                                                             flavor):
    name = f"e2e-{flavor}"
    handle = submit(cluster, handles, job_file(tmp_path, name, flavor))
    assert handle == f"k8s://default/{flavor}/{name}"
    wait_for(cluster, handle, {"SUCCEEDED"})

    # the pods were made by the real controllers, not by us
    found = pods(cluster, name)
    owners = {ref["kind"] for p in found for ref in p["metadata"].get("ownerReferences", [])}
    assert owners == {POD_OWNER[flavor]}, owners
    if flavor == "pytorchjob":  # the operator's env and init container
        env = {e["name"] for p in found for c in p["spec"]["containers"] for e in c.get("env", [])}
        assert {"MASTER_ADDR", "MASTER_PORT", "PET_NNODES", "PET_NODE_RANK"} <= env, env
        workers = [p for p in found if p["metadata"]["labels"].get(PYTORCHJOB_REPLICA_TYPE) == "worker"]
        assert workers and all(p["spec"].get("initContainers") for p in workers)
    if flavor == "trainjob":  # Trainer -> JobSet -> Job -> Pod
        assert all(p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name for p in found)

    nodes = [p["spec"]["nodeName"] for p in found]
    assert len(set(nodes)) == len(nodes) == 2, nodes  # one pod per node (k8s.one_pod_per_node)
    log0 = logs(cluster, handle, 0)
    [summary] = summaries(log0)
    assert_trained_on_two_pods(summary, {p["spec"].get("hostname") or p["metadata"]["name"] for p in found})
    # the progress record, from the end of rank 0's pod log, and the pod's wait to be scheduled
    line = status_line(cluster, handle)
    steps = summary["steps"]
    assert line.startswith(f"SUCCEEDED  step {steps}/{steps} (100%)") and " waited " in line, line
    assert "goodput " in line and "restarts 0/" in line, line
    if flavor == "trainjob":  # the same record, through Trainer's status server
        assert_trainer_status(cluster, name, step=steps, total=steps)
    log1 = logs(cluster, handle, 1)
    assert log1.strip() and "ddpkit-summary" not in log1  # rank 1's own log, not rank 0's
    assert log1 != log0

    proc = ddpkit("cancel", handle, env=cluster, timeout=360)
    assert proc.returncode == 0, proc.stderr
    # cancel waits, as `kubectl delete` does: when it returns the workload is gone, so the same
    # name can be submitted again at once
    workload = kubectl(cluster, "get", WORKLOAD[flavor], name, check=False)
    assert workload.returncode != 0 and "NotFound" in workload.stderr, workload.stdout + workload.stderr
    wait_no_leftovers(cluster, flavor, name)


def assert_trainer_status(cluster, name: str, *, step: int, total: int) -> None:
    """The TrainJob's `status.trainerStatus`, which Kubeflow Trainer's status server (feature
    gate TrainJobStatus, on in the testbed) set from what rank 0 POSTed: the last record's."""
    trainjob = json.loads(kubectl(cluster, "get", "trainjob", name, "-o", "json", "--show-managed-fields").stdout)
    got = trainjob["status"].get("trainerStatus")
    assert got, trainjob["status"]
    metrics = {m["name"]: m["value"] for m in got["metrics"]}
    assert got["progressPercentage"] == 100 * step // total and metrics["step"] == str(step), got
    assert metrics["total_steps"] == str(total) and got["estimatedRemainingSeconds"] == 0, got
    assert "goodput" in metrics and got["lastUpdatedTime"].endswith("Z"), got
    managers = {m["manager"] for m in trainjob["metadata"]["managedFields"]}
    assert "trainer-status" in managers, managers  # the status server's field manager applied it


def wait_for_line(cluster, handle: str, wanted: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while wanted not in (line := status_line(cluster, handle)):
        assert time.monotonic() < deadline, f"{handle}: {line!r}, waiting for {wanted!r}\n{describe(cluster, handle)}"
        time.sleep(1)
    return line


def node_count(cluster) -> int:
    return len(json.loads(kubectl(cluster, "get", "nodes", "-o", "json").stdout)["items"])


def gpu_job(tmp_path: Path, name: str, nodes: int) -> Path:
    """A GPU-shaped PyTorchJob, as a user renders it for a real cluster: `nodes` x 8 GPUs (the
    testbed's nodes advertise 8 nvidia.com/gpu each, for the scheduler only: the pods that land
    find no CUDA and train on CPU until cancelled)."""
    path = job_file(tmp_path, name, "pytorchjob")
    job = yaml.safe_load(path.read_text())
    job.update(nodes=nodes, gpus_per_node=8)
    job.pop("procs_per_node", None)
    # 8 CPU ranks of the cnn (one per "GPU") peak at 1.0-1.3 GiB with their template (measured
    # under a memory cgroup for 45 s): 1Gi got the one-node job's pod OOMKilled once in CI
    job["resources"] = {"cpus_per_node": 0.1, "memory": "3Gi", "shm": "256Mi"}
    job["k8s"]["termination_grace"] = "2s"  # cancelled, never finished: no checkpoint to wait for
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def placed(cluster, name: str, want: int, timeout: float = 120) -> list[dict]:
    """The job's pods once `want` of them are bound to a node."""
    deadline = time.monotonic() + timeout
    while len(bound := [p for p in pods(cluster, name) if p["spec"].get("nodeName")]) < want:
        assert time.monotonic() < deadline, f"{name}: {len(bound)} of {want} pods placed"
        time.sleep(1)
    return bound


def test_gpu_requests_are_judged_by_the_scheduler_and_status_says_why_pods_wait(cluster, image, handles, tmp_path):
    """GPUs as the scheduler sees them: a 2 x 8-GPU job gets one pod per node with its GPUs; a
    second one waits whole, PENDING in the scheduler's words; and a job that only partly fits
    says how many of its pods are not scheduled (its master would wait out its rendezvous)."""
    n = node_count(cluster)
    require(n >= 2, f"the testbed has {n} node(s); GPU placement across nodes needs 2")
    first = submit(cluster, handles, gpu_job(tmp_path, "e2e-gpu-a", nodes=n))
    bound = placed(cluster, "e2e-gpu-a", n)
    assert len({p["spec"]["nodeName"] for p in bound}) == n, [p["spec"]["nodeName"] for p in bound]
    for p in bound:
        [trainer] = [c for c in p["spec"]["containers"] if c["name"] == "pytorch"]
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8", trainer["resources"]
    second = submit(cluster, handles, gpu_job(tmp_path, "e2e-gpu-b", nodes=n))
    line = wait_for_line(cluster, second, "not scheduled")
    assert line.startswith(f"PENDING (not scheduled: Unschedulable: 0/{n} nodes are available: "
                           f"{n} Insufficient nvidia.com/gpu"), line
    why = ddpkit("why", second, env=cluster).stdout.splitlines()
    assert why[0].startswith(f"unschedulable: not scheduled: Unschedulable: 0/{n} nodes are available"), why
    for handle in (first, second):
        assert ddpkit("cancel", handle, env=cluster, timeout=360).returncode == 0
    # one node's GPUs taken by a one-node job: a two-node job gets one pod placed, not both
    one = submit(cluster, handles, gpu_job(tmp_path, "e2e-gpu-one", nodes=n - 1))
    placed(cluster, "e2e-gpu-one", n - 1)
    half = submit(cluster, handles, gpu_job(tmp_path, "e2e-gpu-half", nodes=n))
    line = wait_for_line(cluster, half, f"1 of {n} pods not scheduled")
    assert "Insufficient nvidia.com/gpu" in line, line
    for handle in (one, half):
        assert ddpkit("cancel", handle, env=cluster, timeout=360).returncode == 0


def test_readme_path_render_pipe_kubectl_apply_then_wait(cluster, image, tmp_path):
    name = "e2e-readme"
    path = job_file(tmp_path, name, "pytorchjob")
    shell = (f"ddpkit render k8s {path} | kubectl apply -f - && "
             f"kubectl wait --for=condition=Succeeded pytorchjob/{name} --timeout={JOB_TIMEOUT_S}s")
    # `ddpkit` as the user has it: the console script next to this interpreter
    assert shutil.which("ddpkit", path=str(Path(sys.executable).parent)), "ddpkit is not installed"
    env = dict(cluster, PATH=f"{Path(sys.executable).parent}{os.pathsep}{cluster['PATH']}")
    try:
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", shell], env=env, capture_output=True,
                              text=True, timeout=JOB_TIMEOUT_S + 60)
        assert proc.returncode == 0, proc.stdout + proc.stderr + describe(cluster, f"k8s://default/pytorchjob/{name}")
        assert f"pytorchjob.kubeflow.org/{name} condition met" in proc.stdout
        assert "which kubectl" not in proc.stderr
        assert status(cluster, f"k8s://default/pytorchjob/{name}") == "SUCCEEDED"
    finally:
        ddpkit("cancel", f"k8s://default/pytorchjob/{name}", "--wait", "0", env=cluster)


def _break(flavor: str, obj: dict) -> str:
    """Make the workload invalid in a way only the controller's webhook (or, for Job, the API
    server) knows about; return who must refuse it."""
    spec = obj["spec"]
    if flavor == "pytorchjob":
        spec["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
        return 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied'
    if flavor == "jobset":
        spec["successPolicy"] = {"operator": "All", "targetReplicatedJobs": ["no-such-job"]}
        return "does not appear in .spec.ReplicatedJobs"  # JobSet's webhook, not the schema
    if flavor == "trainjob":
        spec["runtimeRef"]["name"] = "no-such-runtime"
        return 'admission webhook "validator.trainjob.trainer.kubeflow.org" denied'
    spec["completions"] = -1
    return "is invalid"


def rendered(cluster, example: Path, flavor: str) -> str:
    """The manifest, as `ddpkit render k8s` prints it. (Every example in every flavor that
    expresses it is judged by the API server in tests/test_lint_corpus.py.)"""
    proc = ddpkit("render", "k8s", str(example), "--flavor", flavor, "--set", f"name=dry-{flavor}",
                  env=cluster)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_broken_manifest_is_refused_by_the_server_or_webhook(cluster, flavor):
    docs = list(yaml.safe_load_all(rendered(cluster, QUICK, flavor)))
    workload = docs[-1]
    who = _break(flavor, workload)
    proc = kubectl(cluster, "apply", "--dry-run=server", "-f", "-",
                   input=yaml.safe_dump_all(docs), check=False)
    assert proc.returncode != 0, proc.stdout
    assert who in proc.stderr, proc.stderr


def test_kind_e2e_script_runs_against_the_testbed(cluster, image, tmp_path):
    """The script's own path (render, lint against the served CRDs, strict apply, wait, logs,
    cancel) for one flavor: every flavor's training on the testbed is
    test_flavor_trains_across_pods_and_cancel_leaves_nothing's (the four took 331 s here)."""
    env = dict(cluster, PATH=f"{Path(sys.executable).parent}{os.pathsep}{cluster['PATH']}",
               CLUSTER="existing", IMAGE=IMAGE, OUT=str(tmp_path), TIMEOUT_S="600", FLAVORS="pytorchjob",
               EXTRA_SETS="--set resources.cpus_per_node=0.7 --set resources.memory=2Gi "
                          "--set train.plot=false")
    proc = subprocess.run(["bash", str(REPO / "k8s" / "kind" / "e2e.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=4 * JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "every flavor succeeded: pytorchjob" in proc.stderr


@pytest.mark.parametrize("flavor", ["pytorchjob", "job", "trainjob"])
def test_your_own_torchrun_script_runs_unchanged_across_pods(cluster, image, handles, tmp_path, flavor):
    """examples/own_script/train.py (textbook DDP, no ddpkit) as `script:` on a hostPath volume
    (the script reaches the pods by a volume; baking it into the image is the other way):
    2 pods x 2 ranks, identical parameters on all four, files on the shared volume. As a
    TrainJob, its progress (8 steps, the job file's `steps:`) reaches the TrainJob's status
    through Kubeflow Trainer's status server, with no line of it in the script."""
    code, out = tmp_path / "code", tmp_path / "out"
    code.mkdir()
    out.mkdir()
    os.chmod(out, 0o777)  # the image runs as uid 1000
    shutil.copy(REPO / "examples" / "own_script" / "train.py", code / "train.py")
    name = f"e2e-own-{flavor}"
    job = yaml.safe_load((REPO / "examples" / "own-script.yaml").read_text())
    job.update(name=name, image=image, nodes=2, script="/code/train.py",
               args=["--epochs", "1", "--samples", "1024", "--out", "/out"], steps=8,
               resources={"cpus_per_node": 0.7, "memory": "2Gi", "shm": "256Mi"},
               volumes=[{"name": "code", "mount": "/code", "host_path": str(code), "read_only": True},
                        {"name": "out", "mount": "/out", "host_path": str(out)}],
               k8s={"flavor": flavor})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    handle = submit(cluster, handles, path)
    wait_for(cluster, handle, {"SUCCEEDED"})
    text = logs(cluster, handle, 0) + logs(cluster, handle, 1)
    lines = set(re.findall(r"rank (\d)/4 on (\S+): params sha256 ([0-9a-f]{64})", text))
    assert sorted(int(r) for r, _, _ in lines) == [0, 1, 2, 3], text[-3000:]
    assert len({h for _, h, _ in lines}) == 2  # two pods
    assert len({s for _, _, s in lines}) == 1  # identical on every rank
    sums = {p.name: p.read_text().strip() for p in out.glob("params-rank*.sha256")}
    assert sorted(sums) == [f"params-rank{r}.sha256" for r in range(4)]
    assert set(sums.values()) == {s for _, _, s in lines}
    assert "context " in text and "/code/train.py --epochs 1" in text
    if flavor == "trainjob":
        assert_trainer_status(cluster, name, step=8, total=8)


def test_an_accelerate_script_trains_across_pods_or_hangs_and_ddpkit_says_which(cluster, accelerate_image,
                                                                                handles, tmp_path):
    """tests/frameworks/accelerate_loop.py (an Accelerate loop of our own, no ddpkit in it),
    shipped by `workdir:` to 2 pods x 1 rank of a plain Indexed Job, two jobs at once: one trains
    (the same parameters on both pods; `status` counts its 20 steps; `why` says completed), one
    whose rank 1 sleeps in its own code at step 8: the script watchdog ends it, naming rank 1,
    its pod and its line."""
    submitted = {}
    for fault in ("", "hang"):
        tree = tmp_path / (fault or "ok")
        tree.mkdir()
        shutil.copy(REPO / "tests" / "frameworks" / "accelerate_loop.py", tree / "loop.py")
        job = {"name": f"e2e-acc-{fault or 'ok'}", "image": accelerate_image, "nodes": 2, "procs_per_node": 1,
               "workdir": ".", "script": "loop.py", "steps": 20, "restarts": 0,
               "resources": {"cpus_per_node": 0.7, "memory": "2Gi", "shm": "64Mi"},
               "env": {"OMP_NUM_THREADS": "1", "FAULT": fault, "STEPS": "20"}, "train": {"hang_floor_s": 3},
               "k8s": {"flavor": "job"}}
        (tree / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
        submitted[fault] = submit(cluster, handles, tree / "job.yaml")
    ok, hung = submitted[""], submitted["hang"]
    wait_for(cluster, ok, {"SUCCEEDED"})
    text = logs(cluster, ok, 0) + logs(cluster, ok, 1)
    sums = re.findall(r"rank (\d)/2: params sha256 ([0-9a-f]{64})", text)
    assert sorted(r for r, _ in sums) == ["0", "1"] and len({s for _, s in sums}) == 1, text[-3000:]
    progress = json.loads(ddpkit("status", ok, "--json", env=cluster).stdout)["progress"]
    assert (progress["step"], progress["state"]) == (20, "completed"), progress
    why = ddpkit("why", ok, env=cluster).stdout.splitlines()
    assert why[0] == "completed: attempt 0: step 20/20", why

    wait_for(cluster, hung, {"FAILED"})
    why = ddpkit("why", hung, env=cluster).stdout.splitlines()
    line = next(i for i, text in enumerate((REPO / "tests/frameworks/accelerate_loop.py").read_text().splitlines(), 1)
                if "FAULT=hang" in text and "sleep" in text)
    assert why[0].startswith("hang: rank 1 on e2e-acc-hang-"), why
    assert f"loop.py:{line} in main (outside any collective)" in why[0], why


# --------------------------------------------------------------------------------------------
# What `restarts: N` gives on each flavor, read from the real objects (issue 10 item 5).
# Each job is 2 pods of the testbed's busybox image (no training image needed) running a
# script: node 1 fails (exit 1) its first FAILS runs, counted in a file on a hostPath volume
# that survives pod replacement; node 0 waits for node 1 to finish. The jobs of every case are
# submitted together at the start (the longest waits are the kubelet's restart back-off, 10 s
# doubling), then each test reads its flavor's outcome.

RESTART_SCRIPT = r"""
rank=${PET_NODE_RANK:-$JOB_COMPLETION_INDEX}
count=/out/failures-$rank
n=$(cat $count 2>/dev/null || echo 0)
if [ "$rank" = 1 ] && [ "$n" -lt "$FAILS" ]; then
  echo $((n + 1)) > $count; echo "node 1: failure $((n + 1)) of $FAILS"; exit "${CODE:-1}"
fi
if [ "$rank" = 1 ]; then echo done > /out/done; echo "node 1: done"; exit 0; fi
i=0; while [ ! -f /out/done ] && [ $i -lt 400 ]; do sleep 1; i=$((i + 1)); done
echo "node 0: node 1 is done"
"""
#: flavor -> (restarts, node-1 failures the job survives). The survivals are the controllers':
#: pytorchjob: the operator fails the job when the restart counts of all pods reach
#:   runPolicy.backoffLimit = restarts x nodes + 1, so one pod alone may restart 2 times;
#: job: backoffLimitPerIndex = restarts (each node may fail that often);
#: jobset: failurePolicy.maxRestarts = restarts (each failure recreates every pod);
#: trainjob: the torch-distributed runtime's pods restart in place (OnFailure) under the Job
#:   default backoffLimit 6, whatever `restarts` says (0 here): 2 failures shown survived; the
#:   6th restart failing it would take ~5 min of back-off and is not run.
RESTART_CASES = {"pytorchjob": (1, 2), "job": (1, 1), "jobset": (1, 1), "trainjob": (0, 2)}


def restart_job_file(directory: Path, name: str, flavor: str, restarts: int, fails: int) -> Path:
    out = directory / "out"
    out.mkdir()
    os.chmod(out, 0o777)
    job = {"name": name, "image": testbed.BUSYBOX_IMAGE, "nodes": 2, "procs_per_node": 1,
           "restarts": restarts, "command": ["sh", "-c", RESTART_SCRIPT],
           "env": {"FAILS": str(fails)}, "checkpoint": {"ephemeral": True},
           "resources": {"cpus_per_node": 0.05, "memory": "32Mi", "shm": "16Mi"},
           "volumes": [{"name": "out", "mount": "/out", "host_path": str(out)}],
           "k8s": {"flavor": flavor, "termination_grace": 2}}
    if flavor != "trainjob":  # a TrainJob cannot set it; the image is on the node either way
        job["image_pull_policy"] = "Never"
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def restart_runs(cluster, tmp_path_factory, request):
    """(flavor, fails) -> (handle, out dir, job file) for every case this session runs, all
    submitted at once: `survived` failures (must succeed) and, except for trainjob, one more
    (must fail)."""
    selected = {item.callspec.params["flavor"] for item in request.session.items
                if item.originalname == "test_restarts_survived_then_one_more_failure_fails_the_job"}
    runs = {}
    for flavor, (restarts, survived) in RESTART_CASES.items():
        if flavor not in selected:
            continue
        for fails in [survived] + ([survived + 1] if flavor != "trainjob" else []):
            name = f"rs-{flavor}-{fails}"
            ddpkit("cancel", f"k8s://default/{flavor}/{name}", "--wait", "0", env=cluster)  # an earlier run's
            wait_no_leftovers(cluster, flavor, name)
            directory = tmp_path_factory.mktemp(name)
            path = restart_job_file(directory, name, flavor, restarts, fails)
            proc = ddpkit("submit", "k8s", str(path), env=cluster)
            assert proc.returncode == 0, proc.stderr
            runs[flavor, fails] = (proc.stdout.strip(), directory / "out", path)
    yield runs
    for handle, _, _ in runs.values():
        ddpkit("cancel", handle, "--wait", "0", env=cluster)


def wait_end(cluster, handle: str, timeout: float = 400) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = k8s_report(cluster, handle).state
        if state in ("SUCCEEDED", "FAILED"):
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"{handle} is still {state} after {timeout}s\n{describe(cluster, handle)}")
        time.sleep(2)


def get_json(cluster, *args: str) -> dict:
    return json.loads(kubectl(cluster, "get", *args, "-o", "json").stdout)


def node_pods(cluster, flavor: str, name: str) -> dict[int, list[dict]]:
    """Every pod of the job (replaced ones too, while they exist) by node rank."""
    from deploy.k8s import flavor as flavor_module

    found = pods(cluster, name)
    ranks: dict[int, list[dict]] = {}
    for pod in found:
        ranks.setdefault(flavor_module(flavor).node_rank(pod, found), []).append(pod)
    return ranks


def restart_count(pod: dict) -> int:
    return sum(s.get("restartCount", 0) for s in pod["status"].get("containerStatuses") or [])


def failures(out: Path) -> int:
    path = out / "failures-1"
    return int(path.read_text()) if path.exists() else 0


def emulated_limit(path: Path):
    """What `run --docker` would do with the same job (deploy/run/docker.py restart_policy)."""
    from deploy.k8s.render import render_objects
    from deploy.load import load_job
    from deploy.run.docker import restart_policy

    return restart_policy(render_objects(load_job(str(path))))


@pytest.mark.parametrize("flavor", list(RESTART_CASES))
def test_restarts_survived_then_one_more_failure_fails_the_job(cluster, restart_runs, flavor):
    restarts, survived = RESTART_CASES[flavor]
    handle, out, path = restart_runs[flavor, survived]
    name = name_of(handle)
    assert wait_end(cluster, handle) == "SUCCEEDED", describe(cluster, handle)
    assert failures(out) == survived
    by_rank = node_pods(cluster, flavor, name)
    obj = get_json(cluster, WORKLOAD[flavor], name)
    if flavor in ("pytorchjob", "trainjob"):
        # restarted in place (OnFailure): one pod per node, node 1's container restarted
        # `survived` times, node 0 left alone
        assert [len(by_rank[r]) for r in (0, 1)] == [1, 1], by_rank
        assert [restart_count(by_rank[r][0]) for r in (0, 1)] == [0, survived]
    if flavor == "pytorchjob":
        assert obj["spec"]["runPolicy"]["backoffLimit"] == restarts * 2 + 1
        assert all(r["restartPolicy"] == "OnFailure" for r in obj["spec"]["pytorchReplicaSpecs"].values())
    if flavor == "trainjob":  # what the runtime made of it: the JobSet's Job, read live
        [job] = get_json(cluster, "jobs", "-l", f"jobset.sigs.k8s.io/jobset-name={name}")["items"]
        assert job["spec"]["backoffLimit"] == 6
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    if flavor == "job":
        # node 1's pod replaced (a new pod per failure, the failed ones kept); node 0's untouched
        assert len(by_rank[0]) == 1 and restart_count(by_rank[0][0]) == 0
        assert len(by_rank[1]) == survived + 1
        assert obj["status"]["failed"] == survived and obj["status"]["succeeded"] == 2
        assert obj["spec"]["backoffLimitPerIndex"] == restarts and obj["spec"]["maxFailedIndexes"] == 0
    if flavor == "jobset":
        # every Job recreated per failure: node 0's pod is new too
        assert obj["status"]["restarts"] == survived
        attempts = {p["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"]
                    for r in (0, 1) for p in by_rank[r]}
        assert attempts == {str(survived)}, attempts
    policy = emulated_limit(path)  # run --docker says the same
    if flavor == "trainjob":  # the runtime's limit: the 6th restart reaches backoffLimit 6
        assert policy.limit == job["spec"]["backoffLimit"] - 1 and policy.scope == "pod", policy
        return
    assert policy.limit == survived, policy
    handle, out, _ = restart_runs[flavor, survived + 1]
    assert wait_end(cluster, handle) == "FAILED", describe(cluster, handle)
    assert failures(out) == survived + 1  # it was not restarted again
    obj = get_json(cluster, WORKLOAD[flavor], name_of(handle))
    failed = next(c for c in obj["status"]["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True"
    if flavor == "pytorchjob":
        assert "backoff limit" in failed["message"], failed
    if flavor == "job":
        assert obj["status"]["failedIndexes"] == "1", obj["status"]
    if flavor == "job":  # its failed pods stay (pytorchjob's operator removes them): the kubelet's words
        why = ddpkit("why", handle, env=cluster).stdout.splitlines()
        assert why[0].startswith("failed: FAILED") and "[node rank 1: Error (exit 1)" in why[0], why
    if flavor == "jobset":
        assert obj["status"]["restarts"] == survived, obj["status"]


def workload_of(objects: list[dict]) -> dict:
    return next(o for o in objects if o["kind"] == "PyTorchJob")


def test_pytorchjob_exit_code_policy_recreates_128_to_255_without_limit_and_fails_at_once_below(cluster, tmp_path):
    """restartPolicy ExitCode (a user's edit: ddpkit renders OnFailure). The operator runs the pods
    `Never`, deletes and recreates a pod that failed with a retryable code (128-255) and fails
    the job at once on any other. A recreated pod starts at restart count 0, so
    runPolicy.backoffLimit (3 here) never stops a retryable loop (kubeflow/trainer#2045): 4
    failures pass. `run --docker` plans the same, and `ddpkit lint` warns about the policy."""
    from deploy.lint.command import lint_object
    from deploy.run.docker import restart_policy

    runs = {}
    for name, code, fails in (("ec-retryable", 137, 4), ("ec-fatal", 1, 1)):
        directory = tmp_path / name
        directory.mkdir()
        path = restart_job_file(directory, name, "pytorchjob", 1, fails)
        job = yaml.safe_load(path.read_text())
        job["env"]["CODE"] = str(code)
        path.write_text(yaml.safe_dump(job))
        handle = f"k8s://default/pytorchjob/{name}"
        ddpkit("cancel", handle, "--wait", "0", env=cluster)  # an earlier run's
        wait_no_leftovers(cluster, "pytorchjob", name)
        proc = ddpkit("render", "k8s", str(path), env=cluster)
        assert proc.returncode == 0, proc.stderr
        objects = list(yaml.safe_load_all(proc.stdout))
        workload = workload_of(objects)
        assert workload["spec"]["runPolicy"]["backoffLimit"] == 3
        for replica in workload["spec"]["pytorchReplicaSpecs"].values():
            replica["restartPolicy"] = "ExitCode"
        kubectl(cluster, "apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects))
        runs[name] = (handle, directory / "out", objects)
    try:
        handle, out, objects = runs["ec-retryable"]
        assert wait_end(cluster, handle) == "SUCCEEDED", describe(cluster, handle)
        assert failures(out) == 4
        live = pods(cluster, "ec-retryable")
        assert all(p["spec"]["restartPolicy"] == "Never" and restart_count(p) == 0 for p in live), live
        policy = restart_policy(objects)  # run --docker: the same, no limit
        assert policy.limit is None and policy.allows(137, 4) and not policy.allows(1, 0), policy
        advice = [p for p in lint_object(workload_of(objects)) if p.rule == "restart-policy"]
        assert advice and all(f.severity == "warning" for f in advice), advice

        handle, out, _ = runs["ec-fatal"]
        assert wait_end(cluster, handle) == "FAILED", describe(cluster, handle)
        assert failures(out) == 1  # never recreated
        obj = get_json(cluster, "pytorchjob", "ec-fatal")
        failed = next(c for c in obj["status"]["conditions"] if c["type"] == "Failed")
        assert failed["status"] == "True" and "is failing because" in failed["message"], failed
    finally:
        for handle, _, _ in runs.values():
            ddpkit("cancel", handle, "--wait", "0", env=cluster)


def test_reimporting_a_tag_leaves_no_replaced_image_behind(cluster):
    """A rebuilt image loaded under the same tag replaces the old one: the ID reference the CRI
    plugin keeps for the old image is removed (the store grew by an image per rebuild)."""
    tag = "ddpkit-reimport-check:1"

    def rows() -> list[list[str]]:
        return [x.split()[:3] for x in testbed._ctr("images", "ls", text=True).stdout.splitlines()[1:]]

    def id_ref_of(manifest: str) -> bool:  # the CRI plugin adds ID references asynchronously
        deadline = time.monotonic() + 30
        while not any(r[0].startswith("sha256:") and r[2] == manifest for r in rows()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    manifests = []
    try:
        for content in (b"one", b"two"):
            testbed._import(testbed.docker_archive(tag, {"/bin/x": content}, ["/bin/x"]))
            [manifest] = [r[2] for r in rows() if r[0] == f"docker.io/library/{tag}"]
            manifests.append(manifest)
            assert id_ref_of(manifest), rows()
        testbed.prune_replaced_images()
        left = rows()
        assert not [r for r in left if r[2] == manifests[0]], left  # gone under every name
        # the current image keeps its tag and its ID reference
        assert [r[0].startswith("sha256:") for r in left if r[2] == manifests[1]].count(True) == 1, left
        assert [f"docker.io/library/{tag}"] == [r[0] for r in left if r[0] == f"docker.io/library/{tag}"
                                                and r[2] == manifests[1]], left
    finally:
        testbed._ctr("images", "rm", f"docker.io/library/{tag}")
        testbed.prune_replaced_images()


def test_the_node_stores_keep_only_images_docker_still_has_as_loaded(cluster, tmp_path):
    """`testbed k8s up` removes from each node what Docker no longer has (removed, or rebuilt under
    the tag), and `remove_image` removes one image from every node: the stores had grown to 19 GB
    of images every test and bench ever loaded, and filled the CI machine's disk."""
    from deploy.image import docker

    require(docker("version", check=False, timeout=15).returncode == 0,
            "no Docker daemon answers (sudo ddpkit testbed docker up)")
    tag, ref = "ddpkit-store-check:1", "docker.io/library/ddpkit-store-check:1"
    (tmp_path / "x").write_text("x")
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY x /x\n")

    def build_and_load(content: str) -> None:
        (tmp_path / "x").write_text(content)
        docker("build", "-q", "-t", tag, str(tmp_path), timeout=120)
        testbed.load_image(tag)
        assert all(ref in testbed.containerd_images(a) for a in testbed.node_sockets())

    try:
        build_and_load("one")
        assert [testbed.prune_unloaded_images(a) for a in testbed.node_sockets()] == [[], []]
        (tmp_path / "x").write_text("rebuilt")
        docker("build", "-q", "-t", tag, str(tmp_path), timeout=120)  # a new ID under the same tag
        assert [testbed.prune_unloaded_images(a) for a in testbed.node_sockets()] == [[ref], [ref]]
        assert not any(ref in testbed.containerd_images(a) for a in testbed.node_sockets())
        build_and_load("three")
        testbed.remove_image(tag)
        assert not any(ref in testbed.containerd_images(a) for a in testbed.node_sockets())
        build_and_load("four")
        docker("rmi", tag)  # gone from Docker: gone from the nodes at the next `up`
        assert [testbed.prune_unloaded_images(a) for a in testbed.node_sockets()] == [[ref], [ref]]
        assert testbed.containerd_images() >= {f"docker.io/library/{testbed.PAUSE_IMAGE}",
                                               f"docker.io/library/{testbed.BUSYBOX_IMAGE}"}
    finally:
        testbed.remove_image(tag)
        docker("rmi", "--force", tag, check=False)


# --------------------------------------------------------------------------------------------
# issue 20: the fault corpus on Kubernetes (docs/faults.md "Why did it fail?"), five jobs submitted
# together: a hang on each of the two most used flavors (PyTorchJob, Job), an image that is not
# on the node, a volume the kubelet cannot mount, a pod over its memory limit.

def corpus_hang_job(tmp_path: Path, name: str, flavor: str, where: str, restarts: int) -> Path:
    """quickstart-2node at 0.4 CPU a pod (both hang jobs and the small ones fit the 2-CPU node at once);
    rank 3 (node rank 1's second worker) stops once: asleep in its forward, stuck in its
    DataLoader worker, or SIGSTOPped in its forward (`where`). Its run directory (stacks, verdict) on the hostPath volume."""
    directory = tmp_path / name
    directory.mkdir()
    path = job_file(directory, name, flavor, max_steps=60, epochs=100, batch_size=32, log_every_steps=5,
                    num_workers=1 if where == "data" else 0, model="tests.user_workloads:hang",
                    model_args={"where": where, "rank": 3, "after": 1200 if where == "data" else 30,
                                "marker": "/out/hung-once"})
    job = yaml.safe_load(path.read_text())
    job.update(restarts=restarts, resources={**job["resources"], "cpus_per_node": 0.4})
    job.pop("slurm", None)  # quickstart's requeue needs restarts >= 1
    job["env"] = {**job.get("env", {}), "PYTHONPATH": "/repo"}  # tests.user_workloads
    job["volumes"].append({"name": "repo", "mount": "/repo", "host_path": str(REPO), "read_only": True})
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def small_job(tmp_path: Path, name: str, **fields) -> Path:
    """One pod, one process, a tenth of a CPU: for faults the kubelet sees before training."""
    path = job_file(tmp_path, name, "job")
    job = yaml.safe_load(path.read_text())
    job.update(nodes=1, procs_per_node=1, restarts=0, resources={"cpus_per_node": 0.1, "memory": "256Mi", "shm": "64Mi"})
    job.pop("slurm", None)  # quickstart's requeue needs restarts >= 1
    for key, value in fields.items():
        job[key] = value(job[key]) if callable(value) else value
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def why_at_end(cluster, handle: str, wanted: set[str], timeout: float = JOB_TIMEOUT_S) -> list[str]:
    """`ddpkit why` once `ddpkit status` says one of `wanted` (a line that contains it), timed."""
    deadline = time.monotonic() + timeout
    while not any(w in (line := k8s_report(cluster, handle).text()) for w in wanted):
        assert time.monotonic() < deadline, f"{handle}: {line!r}\n{describe(cluster, handle)}"
        time.sleep(1)
    started = time.monotonic()
    proc = ddpkit("why", handle, env=cluster)
    took = time.monotonic() - started
    print(f"{name_of(handle)}: `why` answered {took:.1f}s after `{line}`: {proc.stdout.splitlines()[:1]}")
    assert proc.returncode == 0, proc.stderr  # how soon: a figure of bench/fault_corpus.py
    return proc.stdout.splitlines()


def test_the_fault_corpus_on_kubernetes(cluster, image, handles, tmp_path):
    """(1) PyTorchJob, rank 3 stuck in a DataLoader worker, restarts 1: the watchdog names rank
    3 on node rank 1's pod within 30 s, every rank's stacks on the volume, the container
    restarted in place trains on and the job succeeds; `why` of the run directory says
    completed after attempt 0's hang. (2) Job, rank 3 asleep in its forward, restarts 0: the
    same verdict, and `ddpkit why` of the handle says hang, rank 3 and its pod. (3) an image
    that is not on the node (pull policy Never): `image` in the kubelet's words
    (ErrImageNeverPull). (4) a ConfigMap volume that does not exist: `mount` (the kubelet's
    FailedMount event). (5) a 1500 MiB pod whose rank 1 allocates until the OOM killer ends it:
    `oom`. (6) Job, rank 3 SIGSTOPped, restarts 0: `frozen`, its stacks read by py-spy."""
    jobs = {
        "hang-pytorchjob": corpus_hang_job(tmp_path, "hang-pytorchjob", "pytorchjob", "data", restarts=1),
        "hang-job": corpus_hang_job(tmp_path, "hang-job", "job", "forward", restarts=0),
        "no-image": small_job(tmp_path, "no-image", image="ddpkit:no-such-tag", image_pull_policy="Never"),
        "bad-mount": small_job(tmp_path, "bad-mount", volumes=lambda v: [*v, {"name": "cfg", "mount": "/cfg",
                                                                             "config_map": "no-such-config"}]),
        "oom": small_job(tmp_path, "oom", procs_per_node=2, resources={"cpus_per_node": 0.2, "memory": "1500Mi", "shm": "64Mi"},
                         train=lambda t: {**t, "model": "tests.user_workloads:faulty", "max_steps": 200,
                                          "model_args": {"fault": "oom", "rank": 1, "after": 3}},
                         env={"OMP_NUM_THREADS": "1", "PYTHONPATH": "/repo"},
                         volumes=lambda v: [*v, {"name": "repo", "mount": "/repo", "host_path": str(REPO),
                                                 "read_only": True}]),
    }
    for name in jobs:
        ddpkit("cancel", f"k8s://default/{'pytorchjob' if name == 'hang-pytorchjob' else 'job'}/{name}",
               "--wait", "0", env=cluster)  # an earlier run's
    submitted = {name: submit(cluster, handles, path) for name, path in jobs.items()}

    why = why_at_end(cluster, submitted["no-image"], {"ErrImageNeverPull"}, timeout=120)
    assert why[0].startswith("image: ") and "ErrImageNeverPull" in why[0] and "ddpkit:no-such-tag" in why[0], why
    why = why_at_end(cluster, submitted["bad-mount"], {"FailedMount"}, timeout=120)
    assert why[0].startswith("mount: ") and 'configmap "no-such-config" not found' in why[0], why
    for name in ("no-image", "bad-mount"):  # their CPU for the OOM pod
        ddpkit("cancel", submitted[name], "--wait", "0", env=cluster)
    why = why_at_end(cluster, submitted["oom"], {"FAILED"}, timeout=300)
    assert why[0].startswith("oom: "), why + [describe(cluster, submitted["oom"])]

    for name, flavor in (("hang-job", "job"), ("hang-pytorchjob", "pytorchjob")):
        handle = submitted[name]
        why = why_at_end(cluster, handle, {"FAILED"} if flavor == "job" else {"SUCCEEDED"})
        run_dir = tmp_path / name / "out" / name
        debug = run_dir / "debug" / "attempt-0"
        found = json.loads((debug / "verdict.txt").read_text().split("\n}", 1)[0] + "\n}")
        print(f"{name}: found {found['age_s']}s after rank 3 stopped: {found['explain']}")
        assert found["culprits"] == [3] and found["cause"] == "stuck-outside-collective", found
        assert sorted(p.name for p in debug.glob("rank-*.txt")) == [f"rank-{r}.txt" for r in range(4)]
        # node rank 1's pod (the Job's failed pods' peers are deleted): its hostname
        host = {"job": f"{name}-1", "pytorchjob": f"{name}-worker-0"}[flavor]
        assert f"rank 3 on {host} in {'data' if flavor == 'pytorchjob' else 'forward'}" in found["explain"], found
        if flavor == "job":
            assert why[0].startswith(f"hang: rank 3 on {host}: rank 3 on {host} in forward at step "), why
        else:  # restarted in place: the handle says completed; the run directory keeps the hang
            assert why[0].startswith("completed: "), why
            lines = ddpkit("why", str(run_dir), env=cluster).stdout.splitlines()
            assert lines[0].startswith("completed: attempt 1") and lines[1].startswith(f"  attempt 0: hang: rank 3 on {host}"), lines

    # (6) once the others are done (their CPU): a Job whose rank 3 SIGSTOPs itself, restarts 0
    name, host = "hang-stop", "hang-stop-1"
    ddpkit("cancel", f"k8s://default/job/{name}", "--wait", "0", env=cluster)  # an earlier run's
    handle = submit(cluster, handles, corpus_hang_job(tmp_path, name, "job", "stop", restarts=0))
    why = why_at_end(cluster, handle, {"FAILED"})
    debug = tmp_path / name / "out" / name / "debug" / "attempt-0"
    found = json.loads((debug / "verdict.txt").read_text().split("\n}", 1)[0] + "\n}")
    print(f"{name}: found {found['age_s']}s after rank 3 stopped: {found['explain']}")
    assert found["culprits"] == [3] and found["cause"] == "frozen", found
    assert f"rank 3 on {host} (pid " in found["explain"], found
    frozen = (debug / "rank-3.txt").read_text()  # rank 2, in the same pod, read it with py-spy
    assert "stopped (T (stopped)); its stacks read from outside by py-spy" in frozen and "maybe_hang" in frozen, frozen
    assert why[0].startswith(f"hang: rank 3 on {host}: rank 3 on {host} (pid "), why


# --------------------------------------------------------------------------------------------
# issue 19: a node dies mid-run

OUT_OF_SERVICE = "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute"


def node_ready(cluster, node: str) -> str:
    got = kubectl(cluster, "get", "node", node, "-o",
                  "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}", check=False)
    return got.stdout.strip()


@pytest.mark.parametrize("flavor", ["job", "pytorchjob"])
def test_a_node_that_dies_mid_run_is_replaced_and_training_resumes(cluster, image, handles, tmp_path, flavor):
    """Node rank 1's node dies (its link, kubelet, containerd and containers, all at once): the
    node goes NotReady after the controller-manager's grace period (20 s on the testbed), the
    admin marks it out of service (Kubernetes' non-graceful node shutdown: a pod on a node that
    does not answer is never confirmed dead, so no controller replaces it by itself), the pod
    is force-deleted, its controller replaces it on the healthy node, and training resumes from
    the last checkpoint on storage both nodes see. The pods are spread one per node when they
    can be (topology spread, ScheduleAnyway), so the replacement may share the survivor's node.
    (A pod deleted mid-run is the part of this after the force-delete: not a test of its own.)"""
    require(node_count(cluster) >= 2, "a node death needs 2 nodes")
    name = f"e2e-node-{flavor}"
    path = job_file(tmp_path, name, flavor, max_steps=200, epochs=100)
    job = yaml.safe_load(path.read_text())
    job["restarts"] = 2
    job["k8s"] = {"flavor": flavor, "topology_spread": [
        {"max_skew": 1, "topology_key": "kubernetes.io/hostname", "when_unsatisfiable": "ScheduleAnyway"}]}
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    handle = submit(cluster, handles, path)
    out = tmp_path / "out"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while max(metric_steps(out), default=0) < 50:  # past the checkpoints at steps 20 and 40
        assert time.monotonic() < deadline, describe(cluster, handle)
        time.sleep(0.5)
    bound = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods(cluster, name)}
    victim = next(p for p in pods(cluster, name)
                  if p["metadata"]["labels"].get(PYTORCHJOB_REPLICA_TYPE) == "worker" or
                  p["metadata"].get("annotations", {}).get(COMPLETION_INDEX_KEY) == "1")
    dead = victim["spec"]["nodeName"]
    assert len(set(bound.values())) == 2, bound  # spread: one pod per node
    killed = time.monotonic()
    testbed.kill_node(int(dead.rsplit("-", 1)[1]))
    try:
        while node_ready(cluster, dead) == "True":
            assert time.monotonic() - killed < 120, f"{dead} still Ready"
            time.sleep(1)
        not_ready = time.monotonic() - killed
        line = wait_for_line(cluster, handle, f"on lost node {dead}: NotReady", timeout=60)
        assert ddpkit("why", handle, env=cluster).stdout.startswith("node-lost: "), line
        kubectl(cluster, "taint", "node", dead, OUT_OF_SERVICE)
        resumed = None  # kill -> a step trained again (none when the resume point was the last step)
        while resumed is None and k8s_report(cluster, handle).state != "SUCCEEDED":
            assert time.monotonic() - killed < JOB_TIMEOUT_S, describe(cluster, handle)
            for _ in range(10):
                if max(Counter(metric_steps(out)).values()) >= 2:
                    resumed = time.monotonic() - killed
                    break
                time.sleep(0.5)
        wait_for(cluster, handle, {"SUCCEEDED"})
        final = summaries(logs(cluster, handle, 0))[-1]
        assert final["steps"] == 200
        assert final["resumed_from_step"] and final["resumed_from_step"] >= 40, final
        assert final["params_identical"] is True
        now = pods(cluster, name)
        assert victim["metadata"]["uid"] not in {p["metadata"]["uid"] for p in now}
        assert dead not in {p["spec"].get("nodeName") for p in now}, [p["spec"].get("nodeName") for p in now]
        print(f"node death, {flavor}: kill -> NotReady {not_ready:.0f} s, kill -> training again "
              f"{resumed or float('nan'):.0f} s")
    finally:
        testbed.revive_node(int(dead.rsplit("-", 1)[1]))  # the machine boots again, as one does


def test_a_node_death_with_no_restarts_left_ends_failed_naming_the_node(cluster, image, handles, tmp_path):
    """`restarts: 0`: a Job and a PyTorchJob lose a node at once. Each ends FAILED (the
    survivors' collectives fail, or the lost pod counts as failed), and `ddpkit status` and `why`
    name the lost node: the lost pod stays bound to it, Terminating, evicted by the taint
    manager after `k8s.node_lost_after` (10 s here), until someone deletes the node or taints it
    out of service."""
    require(node_count(cluster) >= 2, "a node death needs 2 nodes")
    runs = {}
    for flavor in ("job", "pytorchjob"):
        path = job_file(tmp_path, f"e2e-lost-{flavor}", flavor, max_steps=2000, epochs=100)
        job = yaml.safe_load(path.read_text())
        job["restarts"] = 0
        job.get("slurm", {}).pop("requeue", None)
        job["k8s"]["node_lost_after"] = 10
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        runs[flavor] = submit(cluster, handles, path)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while max(metric_steps(tmp_path / "out"), default=0) < 20 or \
            any(k8s_report(cluster, h).state != "RUNNING" for h in runs.values()):
        assert time.monotonic() < deadline, [describe(cluster, h) for h in runs.values()]
        time.sleep(1)
    nodes = [{p["spec"]["nodeName"] for p in pods(cluster, f"e2e-lost-{f}")} for f in runs]
    dead = sorted(set.intersection(*nodes))[0]  # 2 pods a job, one per node: they share a node
    killed = time.monotonic()
    testbed.kill_node(int(dead.rsplit("-", 1)[1]))
    try:
        for flavor, handle in runs.items():
            line = wait_for_line(cluster, handle, "FAILED (node rank ", timeout=240)
            assert f"on lost node {dead}: NotReady" in line, line
            named = time.monotonic() - killed
            why = ddpkit("why", handle, env=cluster).stdout
            assert why.startswith("node-lost: node rank ") and f"on lost node {dead}" in why.splitlines()[0], why
            print(f"node death with restarts 0, {flavor}: kill -> FAILED naming {dead} {named:.0f} s")
    finally:
        testbed.revive_node(int(dead.rsplit("-", 1)[1]))


def node_label(cluster, node: str, key: str) -> str:
    escaped = key.replace(".", "\\.")
    return kubectl(cluster, "get", "node", node, "-o", f"jsonpath={{.metadata.labels.{escaped}}}",
                   check=False).stdout.strip()


def test_a_node_lost_and_back_gets_none_of_the_jobs_pods_again(cluster, image, handles, tmp_path):
    """k8s.avoid_lost_nodes (issue 21 item 4): node rank 1's node dies while `ddpkit status
    --watch` follows the job; once the node is NotReady the watcher labels it
    `avoid.ddpkit.io/<job>=lost`. The node then comes back (Ready, before anything evicted the
    pod), the kubelet finds the pod's container gone and fails it, and the Job makes another
    pod. The topology spread (ScheduleAnyway, max skew 1) would put it back on that node, the
    emptier one; the rendered node affinity keeps it off, so it joins the survivor's node,
    training resumes from the last checkpoint and the job succeeds; the watcher then takes the
    label off."""
    require(node_count(cluster) >= 2, "a node death needs 2 nodes")
    name = "e2e-avoid"
    path = job_file(tmp_path, name, "job", max_steps=200, epochs=100)
    job = yaml.safe_load(path.read_text())
    job["restarts"] = 2
    job["k8s"] = {"flavor": "job", "topology_spread": [
        {"max_skew": 1, "topology_key": "kubernetes.io/hostname", "when_unsatisfiable": "ScheduleAnyway"}]}
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    handle = submit(cluster, handles, path)
    key = f"avoid.ddpkit.io/{name}"
    watched = tmp_path / "watch.log"
    with watched.open("w") as sink:
        watcher = subprocess.Popen([sys.executable, "-m", "deploy", "status", "--watch", "1", handle],
                                   env={**os.environ, **cluster}, stdout=sink, stderr=subprocess.STDOUT)
    out, revived = tmp_path / "out", True
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while max(metric_steps(out), default=0) < 50:  # past the checkpoints at steps 20 and 40
            assert time.monotonic() < deadline, describe(cluster, handle)
            time.sleep(0.5)
        victim = next(p for p in pods(cluster, name)
                      if p["metadata"].get("annotations", {}).get(COMPLETION_INDEX_KEY) == "1")
        dead = victim["spec"]["nodeName"]
        assert len({p["spec"]["nodeName"] for p in pods(cluster, name)}) == 2  # spread: one pod per node
        testbed.kill_node(int(dead.rsplit("-", 1)[1]))
        revived = False
        killed = time.monotonic()
        while node_label(cluster, dead, key) != "lost":
            assert time.monotonic() - killed < 120, watched.read_text()[-2000:] + describe(cluster, handle)
            time.sleep(1)
        print(f"avoid: kill -> {dead} labelled {time.monotonic() - killed:.0f} s")
        testbed.revive_node(int(dead.rsplit("-", 1)[1]))
        revived = True
        while not [p for p in pods(cluster, name) if p["metadata"]["uid"] != victim["metadata"]["uid"]
                   and p["metadata"].get("annotations", {}).get(COMPLETION_INDEX_KEY) == "1"
                   and p["spec"].get("nodeName")]:
            assert time.monotonic() - killed < JOB_TIMEOUT_S, describe(cluster, handle)
            time.sleep(1)
        wait_for(cluster, handle, {"SUCCEEDED"})
        final = summaries(logs(cluster, handle, 0))[-1]
        assert final["steps"] == 200 and final["params_identical"] is True, final
        assert final["resumed_from_step"] and final["resumed_from_step"] >= 40, final
        placed = [p["spec"].get("nodeName") for p in pods(cluster, name)
                  if p["metadata"]["uid"] != victim["metadata"]["uid"]]
        assert dead not in placed, placed
        watcher.wait(timeout=60)  # it ends with the job, after taking the label off
        said = watched.read_text()
        assert f"node {dead} was lost under the job: its pods stay off it (label {key}=lost)" in said, said
        assert f"node {dead} may take the job's pods again" in said, said
        assert node_label(cluster, dead, key) == ""
    finally:
        watcher.kill()
        if not revived:
            testbed.revive_node(int(dead.rsplit("-", 1)[1]))
