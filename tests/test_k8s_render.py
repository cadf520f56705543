"""deploy.k8s.render: goldens per flavor x example, lint of every rendered object, behaviours."""

from __future__ import annotations

import re

import pytest
import yaml

from deploy.errors import UserError
from deploy.k8s import flavor as flavor_module
from deploy.k8s import render as k8s
from deploy.kube import (
    KUEUE_PREFERRED_TOPOLOGY,
    KUEUE_QUEUE_LABEL,
    KUEUE_REQUIRED_TOPOLOGY,
)
from deploy.lint import command as lint
from deploy.load import load_job, parse_job
from deploy.run.docker import controller_pods, resolve_env
from tests.builders import BASE
from tests.conftest import EXAMPLES, cli
from tests.crds import crd_dir

#: Combinations a flavor cannot express: (example stem, flavor) -> the field named in the error.
UNRENDERABLE = {
    ("elastic", "trainjob"): "nodes:", ("elastic", "jobset"): "nodes:", ("elastic", "job"): "nodes:",
    ("multinode-gpu", "trainjob"): "k8s.priority_class:",
}
CASES = [(e, f) for e in EXAMPLES for f in k8s.FLAVORS]


def case_id(case):
    return f"{case[0].stem}-{case[1]}"


@pytest.fixture(scope="module")
def crds():
    return lint.load_crds(crd_dir())


def render(path, flavor):
    return k8s.render_k8s(load_job(str(path)), flavor=flavor, source=f"examples/{path.name}")


def job(**fields):
    # checkpoints in the container are accepted here (deploy/durability.py has its own tests)
    return parse_job({**BASE, **fields})


def objects(spec, flavor):
    return k8s.render_objects(spec, flavor=flavor)


def workload(objs):
    return next(o for o in objs if o["kind"] in ("PyTorchJob", "TrainJob", "JobSet", "Job"))


def pods(objs):
    return [pod.template for pod in controller_pods(objs)]


def container(template):
    return template["spec"]["containers"][0]


def env_of(template):
    return {e["name"]: e for e in container(template)["env"]}


# ---- goldens and lint ----------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_golden(case, golden):
    path, flavor = case
    if (path.stem, flavor) in UNRENDERABLE:
        with pytest.raises(UserError) as err:
            render(path, flavor)
        # located in the job file, like `ddpkit validate` says it (deploy/problems.py)
        assert re.match(rf"{re.escape(str(path))}:\d+: {UNRENDERABLE[(path.stem, flavor)]}",
                        err.value.problems[0]), err.value.problems[0]
        return
    golden(f"k8s/{path.stem}.{flavor}.yaml", render(path, flavor))


@pytest.mark.parametrize("case", [c for c in CASES if (c[0].stem, c[1]) not in UNRENDERABLE],
                         ids=case_id)
def test_every_rendered_object_passes_lint_against_upstream_crds(case, crds):
    path, flavor = case
    text = render(path, flavor)
    found = lint.lint_text(text, crds, source=f"{path.stem}.{flavor}")
    # the one warning a TrainJob on the upstream runtime gets: its pods' restarts are the
    # runtime's, which ddpkit cannot change (docs/kubernetes.md)
    assert [p for p in found if p.rule != "runtime-restarts"] == []
    assert [p.rule for p in found] == (["runtime-restarts"] if flavor == "trainjob" else [])


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_exactly_the_declared_example_and_flavor_pairs_are_refused(example):
    """The list the end-to-end tests take their renderings from (tests/conftest.py)."""
    from tests.conftest import K8S_FLAVORS, REFUSED_RENDERINGS

    assert tuple(k8s.FLAVORS) == K8S_FLAVORS
    for flavor in K8S_FLAVORS:
        result = cli("render", "k8s", str(example), "--flavor", flavor)
        reason = REFUSED_RENDERINGS.get((example.stem, flavor))
        if reason is None:
            assert result.returncode == 0, f"{example.name} as {flavor}: {result.stderr}"
        else:
            assert result.returncode == 2 and reason in result.stderr, (example.name, flavor, result.stderr)


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_rendering_is_the_same_in_every_process(flavor, tmp_path):
    """Two fresh interpreters with other hash seeds (the order of sets and str-keyed dicts),
    working directories and clocks render the same bytes."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    outs = []
    for seed, cwd in (("1", REPO), ("2", tmp_path)):
        proc = subprocess.run([sys.executable, "-m", "deploy", "render", "k8s", str(REPO / "examples" / "quickstart-2node.yaml"),
                               "--flavor", flavor],
                              cwd=cwd, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert outs[0] == outs[1] and "kind:" in outs[0]


# ---- behaviours --------------------------------------------------------------------------------

@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_carries_the_job_file_in_a_configmap_mounted_into_every_pod(flavor):
    spec = job(nodes=2)
    objs = objects(spec, flavor)
    cm = objs[0]
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "demo-job"
    assert yaml.safe_load(cm["data"]["job.yaml"]) == spec.model_dump(mode="json")
    for tpl in pods(objs):
        vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert vols["ddpkit-job"]["configMap"]["name"] == "demo-job"
        assert {"name": "ddpkit-job", "mountPath": "/etc/ddpkit", "readOnly": True} in container(tpl)["volumeMounts"]
        assert env_of(tpl)["DDPKIT_JOB_FILE"]["value"] == "/etc/ddpkit/job.yaml"


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_mounts_a_memory_backed_dev_shm_sized_from_resources_shm(flavor):
    objs = objects(job(resources={"shm": "3Gi"}), flavor)
    for tpl in pods(objs):
        vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
        mount = next(m for m in container(tpl)["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert vols[mount["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_every_object_has_app_kubernetes_io_labels(flavor):
    for obj in objects(job(k8s={"labels": {"team": "ml"}}), flavor):
        got = obj["metadata"]["labels"]
        assert got["app.kubernetes.io/instance"] == "demo"
        assert got["app.kubernetes.io/managed-by"] == "ddpkit" and got["team"] == "ml"


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_container_starts_python_m_trainer_launch(flavor):
    for tpl in pods(objects(job(), flavor)):
        assert container(tpl)["command"] == ["python", "-m", "trainer.launch"]


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_secret_env_uses_secretkeyref_and_never_the_value(flavor):
    spec = job(secret_env=[{"name": "TOKEN", "secret": "s3cr3t-store", "key": "tok"}])
    text = k8s.render_k8s(spec, flavor=flavor)
    for tpl in pods(k8s.parse_objects(text)):
        assert env_of(tpl)["TOKEN"] == {"name": "TOKEN", "valueFrom": {
            "secretKeyRef": {"name": "s3cr3t-store", "key": "tok"}}}


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_gpu_limits_equal_requests_and_processes_per_node(flavor):
    spec = job(gpus_per_node=4, gpu_resource="amd.com/gpu", resources={"cpus_per_node": 1.5,
                                                                       "memory": "8Gi"})
    objs = objects(spec, flavor)
    for tpl in pods(objs):
        res = container(tpl)["resources"]
        assert res["limits"] == res["requests"] == {"cpu": "1500m", "memory": "8Gi", "amd.com/gpu": 4}
        assert env_of(tpl)["DDPKIT_NPROC_PER_NODE"]["value"] == "4"


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_volumes_claim_host_path_nfs_and_empty_dir(flavor):
    spec = job(volumes=[
        {"name": "data", "claim": "imagenet", "mount": "/data", "read_only": True},
        {"name": "host", "host_path": "/mnt/fast", "mount": "/fast"},
        {"name": "share", "nfs": {"server": "nfs.local", "path": "/export"}, "mount": "/share"},
        {"name": "scratch", "empty_dir": {"size_limit": "10Gi"}, "mount": "/scratch"},
    ])
    tpl = pods(objects(spec, flavor))[0]
    vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
    assert vols["data"]["persistentVolumeClaim"] == {"claimName": "imagenet", "readOnly": True}
    assert vols["host"]["hostPath"] == {"path": "/mnt/fast", "type": "Directory"}
    assert vols["share"]["nfs"] == {"server": "nfs.local", "path": "/export", "readOnly": False}
    assert vols["scratch"]["emptyDir"] == {"sizeLimit": "10Gi"}
    mounts = {m["name"]: m for m in container(tpl)["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
    assert mounts["scratch"] == {"name": "scratch", "mountPath": "/scratch"}


@pytest.mark.parametrize("flavor", ["pytorchjob", "jobset", "job"])
def test_scheduling_fields_reach_the_pod(flavor):
    spec = job(k8s={"node_selector": {"pool": "gpu"}, "priority_class": "high",
                    "service_account": "trainer", "image_pull_secrets": ["regcred"],
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "scheduler_name": "volcano"})
    pod = pods(objects(spec, flavor))[0]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["priorityClassName"] == "high" and pod["serviceAccountName"] == "trainer"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}] + [
        {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
        for taint in ("unreachable", "not-ready")]
    assert pod["schedulerName"] == "volcano"


def test_a_lost_node_evicts_after_node_lost_after_unless_the_job_tolerates_it_itself():
    """k8s.node_lost_after is the tolerationSeconds of the lost node's NoExecute taints; a job's
    own toleration for one of them wins; null leaves the cluster's default (300 s)."""
    def tolerations(**k8s):
        return pods(objects(job(k8s=k8s), "job"))[0]["spec"].get("tolerations")

    assert [(t["key"], t["tolerationSeconds"]) for t in tolerations(node_lost_after="2m")] == [
        ("node.kubernetes.io/unreachable", 120), ("node.kubernetes.io/not-ready", 120)]
    own = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
           "toleration_seconds": 5}
    assert [(t["key"], t["tolerationSeconds"]) for t in tolerations(tolerations=[own])] == [
        ("node.kubernetes.io/unreachable", 5), ("node.kubernetes.io/not-ready", 60)]
    assert tolerations(node_lost_after=None) is None


def test_trainjob_patches_scheduling_fields_into_the_runtime():
    spec = job(k8s={"node_selector": {"pool": "gpu"}, "service_account": "trainer",
                    "image_pull_secrets": ["regcred"], "termination_grace": "5m",
                    "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    tj = workload(objects(spec, "trainjob"))
    [patch] = tj["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["serviceAccountName"] == "trainer"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["terminationGracePeriodSeconds"] == 300
    assert pod["containers"][0]["name"] == "node"  # the torch-distributed runtime's container


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_termination_grace_period_leaves_time_for_the_sigterm_checkpoint(flavor):
    for tpl in pods(objects(job(), flavor)):
        assert tpl["spec"]["terminationGracePeriodSeconds"] == 120


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_sidecar_injection_is_off(flavor):
    for tpl in pods(objects(job(), flavor)):
        assert tpl["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_kueue_queue_label_on_the_workload_when_a_queue_is_set(flavor):
    assert KUEUE_QUEUE_LABEL not in workload(objects(job(), flavor))["metadata"]["labels"]
    labels = workload(objects(job(k8s={"queue": "team-a"}), flavor))["metadata"]["labels"]
    assert labels[KUEUE_QUEUE_LABEL] == "team-a"


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_kueue_topology_is_asked_on_every_pod_template(flavor):
    """`k8s.topology`: Kueue's required (or preferred) topology annotation on every pod of the
    job; no pod-set group for a PyTorchJob's Master and Worker (Kueue's leader/workers
    placement of a group drops the rank order: measured by bench/k8s_scale.py --topology)."""
    for required, key in ((True, KUEUE_REQUIRED_TOPOLOGY), (False, KUEUE_PREFERRED_TOPOLOGY)):
        spec = job(nodes=4, k8s={"queue": "gpus", "topology": {"level": "ddpkit.io/rack", "required": required}})
        templates = pods(objects(spec, flavor))
        assert len(templates) == 4
        for tpl in templates:
            annotations = tpl["metadata"]["annotations"]
            assert annotations[key] == "ddpkit.io/rack"
            assert {KUEUE_REQUIRED_TOPOLOGY, KUEUE_PREFERRED_TOPOLOGY} - {key} - set(annotations)
            assert "kueue.x-k8s.io/podset-group-name" not in annotations
    for tpl in pods(objects(job(nodes=4, k8s={"queue": "gpus"}), flavor)):
        assert not {KUEUE_REQUIRED_TOPOLOGY, KUEUE_PREFERRED_TOPOLOGY} & set(tpl["metadata"]["annotations"])


def test_kueue_topology_without_a_queue_or_with_a_bad_label_is_refused():
    with pytest.raises(UserError, match="k8s.topology: is Kueue's topology-aware scheduling: it needs k8s.queue"):
        job(k8s={"topology": {"level": "ddpkit.io/rack"}})
    with pytest.raises(UserError, match="not a node label key"):
        job(k8s={"queue": "gpus", "topology": {"level": "rack label"}})


def test_pytorchjob_has_one_master_and_nodes_minus_one_workers_named_pytorch():
    pj = workload(objects(job(nodes=4, procs_per_node=3, restarts=2, time_limit="2h"), "pytorchjob"))
    replicas = pj["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    for rspec in replicas.values():
        c = container(rspec["template"])
        assert c["name"] == "pytorch"
        assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        assert rspec["restartPolicy"] == "OnFailure"
    assert pj["spec"]["nprocPerNode"] == "3"
    # one failed node makes all 4 restart (their collectives fail), and the operator fails the
    # job when the restarts of every pod *reach* the limit: restarts x nodes + 1
    assert pj["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "backoffLimit": 9,
                                       "activeDeadlineSeconds": 7200 - 120}  # grace before the limit
    assert "restartPolicy" not in rspec["template"]["spec"]  # the replica's decides


def test_pytorchjob_single_node_has_no_worker_and_no_restarts_means_never():
    pj = workload(objects(job(), "pytorchjob"))
    assert list(pj["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert pj["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "Never"


def test_pytorchjob_run_policy_ttl_and_gang_scheduling():
    pj = workload(objects(job(nodes=3, k8s={"gang": True, "ttl_after_finished": "1h",
                                            "priority_class": "high"}), "pytorchjob"))
    run = pj["spec"]["runPolicy"]
    assert run["ttlSecondsAfterFinished"] == 3600
    assert run["schedulingPolicy"] == {"minAvailable": 3, "priorityClass": "high"}


def test_pytorchjob_elastic_policy_when_nodes_is_min_max():
    objs = objects(job(nodes="2:5", restarts=7), "pytorchjob")
    pj = workload(objs)
    assert pj["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2,
                                           "maxReplicas": 5, "maxRestarts": 7}
    assert list(pj["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert pj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 5
    env = env_of(pods(objs)[0])
    assert env["DDPKIT_NNODES"]["value"] == "2:5" and env["DDPKIT_MAX_RESTARTS"]["value"] == "7"
    assert env["DDPKIT_MASTER_ADDR"]["value"] == "demo-worker-0"
    assert env["DDPKIT_MASTER_PORT"]["value"] == "23456"


def test_trainjob_refers_to_the_runtime_and_sets_nodes_and_processes():
    tj = workload(objects(job(nodes=3, gpus_per_node=2, time_limit="1h",
                              k8s={"runtime": "my-torch"}), "trainjob"))
    spec = tj["spec"]
    assert spec["runtimeRef"] == {"name": "my-torch"}
    assert spec["trainer"]["numNodes"] == 3 and spec["trainer"]["numProcPerNode"] == 2
    assert spec["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 2
    assert spec["trainer"]["image"] == "img:1" and spec["activeDeadlineSeconds"] == 3600 - 120
    assert spec["runtimePatches"][0]["manager"] == "ddpkit.io/render"


def test_jobset_has_dns_hostnames_failure_policy_and_pod_zero_as_master():
    objs = objects(job(nodes=3, restarts=4), "jobset")
    js = workload(objs)
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 4}
    [rjob] = js["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 1
    assert rjob["template"]["spec"]["parallelism"] == rjob["template"]["spec"]["completions"] == 3
    env = env_of(pods(objs)[0])
    assert env["DDPKIT_MASTER_ADDR"]["value"] == "demo-node-0-0.demo"
    first = controller_pods(objs)[0]
    assert env["DDPKIT_MASTER_ADDR"]["value"] == f"{first.hostname}.{first.subdomain}"


def test_job_is_indexed_with_a_headless_service_as_its_subdomain():
    objs = objects(job(nodes=3, restarts=2), "job")
    svc = next(o for o in objs if o["kind"] == "Service")
    batch = workload(objs)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert batch["spec"]["completionMode"] == "Indexed"
    assert batch["spec"]["completions"] == batch["spec"]["parallelism"] == 3
    # every node may fail `restarts` times (per index); the total never binds before that
    assert batch["spec"]["backoffLimitPerIndex"] == 2 and batch["spec"]["maxFailedIndexes"] == 0
    assert batch["spec"]["backoffLimit"] == 6
    tpl = batch["spec"]["template"]
    assert tpl["spec"]["subdomain"] == svc["metadata"]["name"]
    assert all(tpl["metadata"]["labels"][k] == v for k, v in svc["spec"]["selector"].items())
    env = env_of(tpl)
    assert env["DDPKIT_MASTER_ADDR"]["value"] == "demo-0.demo"
    assert env["DDPKIT_MASTER_PORT"]["value"] == "29500"


@pytest.mark.parametrize("flavor", ["trainjob", "jobset", "job"])
def test_elastic_nodes_on_a_fixed_size_flavor_is_an_exit_2_error(flavor, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: demo\nimage: img:1\nnodes: '2:4'\ncheckpoint: {ephemeral: true}\n")
    result = cli("render", "k8s", str(path), "--flavor", flavor)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {path}:3: nodes: elastic 2:4 needs the pytorchjob flavor")
    assert "Traceback" not in result.stderr
    # validate finds the very same refusal, with the same line (deploy/problems.py)
    checked = cli("validate", str(path), "--flavor", flavor)
    assert (checked.returncode, checked.stdout, checked.stderr) == (2, "", result.stderr)


@pytest.mark.parametrize(("flavor", "kind"), [("trainjob", "TrainJob"), ("jobset", "JobSet"),
                                              ("job", "Job")])
def test_clean_pod_policy_is_pytorchjob_only(flavor, kind):
    spec = job(k8s={"clean_pod_policy": "All"})
    assert workload(objects(spec, "pytorchjob"))["spec"]["runPolicy"]["cleanPodPolicy"] == "All"
    with pytest.raises(UserError) as err:
        k8s.render_k8s(spec, flavor=flavor)
    assert err.value.problems == [f"job.yaml: k8s.clean_pod_policy: PyTorchJob only; remove it for a {kind}"]


def test_what_a_trainjob_cannot_say_is_an_error_each():
    spec = job(image_pull_policy="Always", k8s={"priority_class": "high", "scheduler_name": "volcano",
                                                 "ttl_after_finished": "1h", "gang": True})
    with pytest.raises(UserError) as err:
        k8s.render_k8s(spec, flavor="trainjob")
    assert [p.split(": ")[1] for p in err.value.problems] == [
        "k8s.gang", "k8s.priority_class", "k8s.scheduler_name", "k8s.ttl_after_finished",
        "image_pull_policy"]
    assert "set k8s.queue" in err.value.problems[0]
    k8s.render_k8s(spec, flavor="pytorchjob")  # every one of them is PyTorchJob-expressible

def test_cli_render_writes_the_file_and_lint_accepts_it(tmp_path):
    out = tmp_path / "out.yaml"
    example = next(p for p in EXAMPLES if p.stem == "multinode-gpu")
    result = cli("render", "k8s", str(example), "--flavor", "job", "-o", str(out))
    assert result.returncode == 0, result.stderr
    check = cli("lint", str(out), "--crds", str(crd_dir()))
    assert check.returncode == 0, check.stdout + check.stderr


def test_user_strings_cannot_break_the_yaml():
    spec = job(env={"WEIRD": "a: b\n- c # d \"e\" 'f' {g}"}, k8s={"annotations": {"note": "x\ny: z"}})
    for flavor in k8s.FLAVORS:
        tpl = pods(objects(spec, flavor))[0]
        assert env_of(tpl)["WEIRD"]["value"] == "a: b\n- c # d \"e\" 'f' {g}"
        assert tpl["metadata"]["annotations"]["note"] == "x\ny: z"


def controller_env(objs, pod):
    """The env a pod's container starts with: what its controller injects, then the manifest's."""
    return resolve_env(pod, container(pod.template), objs, host_env={})


def test_controller_pods_and_env_for_a_pytorchjob_and_a_trainjob():
    objs = objects(job(nodes=3, procs_per_node=2), "pytorchjob")
    pods_ = controller_pods(objs)
    assert [p.name for p in pods_] == ["demo-master-0", "demo-worker-0", "demo-worker-1"]
    env = controller_env(objs, pods_[2])
    assert env["PET_NODE_RANK"] == "2" and env["WORLD_SIZE"] == "6"
    assert env["PET_MASTER_ADDR"] == "demo-master-0" and env["PET_MASTER_PORT"] == "23456"
    tj = objects(job(nodes=2), "trainjob")
    tj_pods = controller_pods(tj)
    assert len(tj_pods) == 2 and container(tj_pods[0].template)["image"] == "img:1"
    assert controller_env(tj, tj_pods[0])["PET_MASTER_ADDR"] == "demo-node-0-0.demo"


def test_env_of_an_elastic_pytorchjob_is_rendezvous_only():
    objs = objects(job(nodes="2:4", procs_per_node=2, restarts=3), "pytorchjob")
    env = controller_env(objs, controller_pods(objs)[1])
    assert env["PET_RDZV_ENDPOINT"] == "demo-worker-0:23456" and env["PET_NNODES"] == "2:4"
    assert env["PET_MAX_RESTARTS"] == "3"
    assert "PET_NODE_RANK" not in env and "MASTER_ADDR" not in env


def launch_plans(objs):
    """trainer.launch's plan for every pod: rendered env plus what the controller injects."""
    from trainer.launch.plan import plan_launch

    return [plan_launch(controller_env(objs, pod)) for pod in controller_pods(objs)]


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_every_pod_of_every_flavor_gets_a_consistent_launch_plan(flavor):
    objs = objects(job(nodes=3, procs_per_node=2, restarts=1), flavor)
    plans = launch_plans(objs)
    assert sorted(p.node_rank for p in plans) == [0, 1, 2]
    host, port = flavor_module(flavor).master_endpoint(job(nodes=3))
    for plan in plans:
        argv = plan.argv
        assert argv[argv.index("--rdzv-endpoint") + 1] == f"{host}:{port}"
        assert argv[argv.index("--nnodes") + 1] == "3"
        assert argv[argv.index("--nproc-per-node") + 1] == "2"
        assert plan.wait_for == (None if plan.node_rank == 0 else (host, port))


def test_elastic_pytorchjob_pods_get_a_launch_plan():
    plans = launch_plans(objects(job(nodes="2:3", procs_per_node=2), "pytorchjob"))
    assert len(plans) == 3
    for plan in plans:
        assert plan.context == "kubeflow-elastic"
        assert plan.argv[plan.argv.index("--nnodes") + 1] == "2:3"


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_dollar_var_means_what_it_means_on_slurm_literal(flavor):
    """`$(VAR)` in env and command reaches the process as written on every target: Slurm exports
    it verbatim (test_slurm_render), and here Kubernetes' expansion (`$(VAR)`, `$$` escape, as
    the Docker runner applies it) must give back the same text."""
    from deploy.run.docker import expand

    written = {"A": "x", "B": "$(A)-$$-$HOME-$(UNSET)"}
    spec = job(env=written, command=["echo", "$(A)", "$$(A)"])
    for template in pods(objects(spec, flavor)):
        env: dict[str, str] = {}
        for item in container(template)["env"]:
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
        assert {k: env[k] for k in written} == written
        assert [expand(a, env) for a in container(template)["command"]] == ["echo", "$(A)", "$$(A)"]


# ---- what real clusters need beyond the basics (issue 10 item 6) ------------------------------

#: Every typed field of item 6 at once (also the testbed's dry-run job: tests/test_k8s_conformance.py).
CLUSTER_FIELDS = {
    "resources": {"cpus_per_node": 1, "memory": "2Gi"},
    "volumes": [{"name": "data", "claim": "imagenet", "mount": "/data"},
                {"name": "creds", "secret": "s3-creds", "mount": "/etc/creds"},
                {"name": "conf", "config_map": "site-conf", "mount": "/etc/site"}],
    "k8s": {
        "extra_resources": {"rdma/ib": "1", "hugepages-2Mi": "1Gi", "ephemeral-storage": "10Gi"},
        "capabilities": ["IPC_LOCK"], "fs_group": 1000, "run_as_user": 1000, "run_as_group": 1000,
        "host_network": True, "one_pod_per_node": True,
        "topology_spread": [{"topology_key": "topology.kubernetes.io/zone"}],
        "init_containers": [{"name": "fetch", "image": "busybox:1.36", "command": ["sh", "-c", "true"]}],
        "sidecars": [{"name": "metrics", "image": "busybox:1.36", "command": ["sleep", "inf"],
                      "env": {"PORT": "9100"}}],
        "job_annotations": {"team.example.com/owner": "ml"},
        "pod_patch": {"metadata": {"labels": {"extra": "yes"}},
                      "spec": {"dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
                               "containers": [{"name": "trainer",
                                               "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}]}]}},
    },
}


def cluster_job(**extra):
    data = {"name": "demo", "image": "img:1", "nodes": 2, "checkpoint": {"ephemeral": True},
            **CLUSTER_FIELDS, "k8s": {**CLUSTER_FIELDS["k8s"], **extra}}
    return parse_job(data)


@pytest.mark.parametrize("flavor", ["pytorchjob", "jobset", "job"])
def test_cluster_fields_reach_every_pod_template(flavor):
    for tpl in pods(objects(cluster_job(), flavor)):
        spec, c = tpl["spec"], container(tpl)
        assert c["resources"]["limits"]["rdma/ib"] == "1" == c["resources"]["requests"]["rdma/ib"]
        assert c["resources"]["limits"]["hugepages-2Mi"] == "1Gi"
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert spec["securityContext"] == {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "demo"
        assert spec["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "DoNotSchedule"
        inits = {i["name"]: i for i in spec["initContainers"]}
        assert "restartPolicy" not in inits["fetch"] and inits["metrics"]["restartPolicy"] == "Always"
        assert inits["metrics"]["env"][0] == {"name": "PORT", "value": "9100"}
        assert inits["fetch"]["volumeMounts"] == c["volumeMounts"]  # the job's volumes
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["creds"]["secret"] == {"secretName": "s3-creds"}
        assert vols["conf"]["configMap"] == {"name": "site-conf"}
        # pod_patch: merged last, by name, `trainer` = the training container
        assert tpl["metadata"]["labels"]["extra"] == "yes"
        assert spec["dnsConfig"] == {"options": [{"name": "ndots", "value": "2"}]}
        assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in c["env"]
        # merged into, not replaced, in the order a strategic merge patch gives (the patch's new
        # item first: tests/test_pod_patch_merge.py checks the order against kubectl)
        assert [e["name"] for e in c["env"]][:2] == ["NCCL_IB_HCA", "DDPKIT_JOB_FILE"]
    assert workload(objects(cluster_job(), flavor))["metadata"]["annotations"] == {
        "team.example.com/owner": "ml"}


def test_cluster_fields_a_trainjob_can_carry_go_into_its_runtime_patch():
    spec = cluster_job(host_network=False, topology_spread=[], init_containers=[], sidecars=[],
                       pod_patch={"spec": {"containers": [{"name": "trainer", "env": [
                           {"name": "NCCL_IB_HCA", "value": "mlx5"}]}]}})
    tj = workload(objects(spec, "trainjob"))
    patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == 1000 and "podAntiAffinity" in pod["affinity"]
    assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    # Trainer's webhook refuses env on the node container of a runtimePatch (seen on the testbed)
    assert "env" not in pod["containers"][0]
    assert tj["spec"]["trainer"]["env"][-1] == {"name": "NCCL_IB_HCA", "value": "mlx5"}
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["rdma/ib"] == "1"
    assert tj["metadata"]["annotations"] == {"team.example.com/owner": "ml"}


def test_a_trainjob_refuses_what_its_runtime_patch_cannot_say():
    with pytest.raises(UserError) as err:
        k8s.render_k8s(cluster_job(), flavor="trainjob")
    fields = {p.split(": ")[1] for p in err.value.problems}
    assert {"k8s.host_network", "k8s.topology_spread", "k8s.init_containers", "k8s.sidecars",
            "k8s.pod_patch.spec.dnsConfig"} <= fields


def test_pod_patch_null_removes_and_unnamed_lists_replace():
    spec = job(k8s={"pod_patch": {"metadata": {"annotations": {"linkerd.io/inject": None}},
                                  "spec": {"terminationGracePeriodSeconds": None,
                                           "tolerations": [{"operator": "Exists"}]}}},
               nodes=1)
    tpl = pods(objects(spec, "job"))[0]
    assert "linkerd.io/inject" not in tpl["metadata"]["annotations"]
    assert "terminationGracePeriodSeconds" not in tpl["spec"]
    assert tpl["spec"]["tolerations"] == [{"operator": "Exists"}]


def test_time_limit_stops_pods_one_grace_period_early_with_the_stop_grace_in_env():
    spec = job(time_limit="1h", k8s={"termination_grace": "5m"})
    for flavor in ("pytorchjob", "jobset", "job"):
        text = k8s.render_k8s(spec, flavor=flavor)
        assert "activeDeadlineSeconds: 3300" in text
        for tpl in pods(objects(spec, flavor)):
            assert env_of(tpl)["DDPKIT_STOP_GRACE_S"]["value"] == "300"
            assert tpl["spec"]["terminationGracePeriodSeconds"] == 300


# Kubernetes' default per image (pkg/apis/core/v1/defaults.go SetDefaults_Container: tag
# `latest`, which ParseImageName also gives a reference with neither tag nor digest -> Always)
PULL_DEFAULTS = [("registry.example/o/t:1.0", "IfNotPresent"), ("registry.example/o/t:latest", "Always"),
                 ("registry.example/o/t", "Always"), ("localhost:5000/t", "Always"),
                 ("localhost:5000/t:2", "IfNotPresent"), ("registry.example/o/t@sha256:" + "a" * 64, "IfNotPresent"),
                 ("registry.example/o/t:1@sha256:" + "a" * 64, "IfNotPresent"),
                 ("registry.example/o/t:latest@sha256:" + "a" * 64, "Always"), ("ubuntu", "Always")]


@pytest.mark.parametrize("flavor", ["pytorchjob", "jobset", "job"])
def test_each_container_s_pull_policy_follows_kubernetes_default_for_its_own_image(flavor):
    images = [image for image, _ in PULL_DEFAULTS]
    spec = job(image=images[0], k8s={
        "init_containers": [{"name": f"i{n}", "image": image} for n, image in enumerate(images)],
        "sidecars": [{"name": f"s{n}", "image": image} for n, image in enumerate(images[::-1])]})
    expected = dict(PULL_DEFAULTS)
    for trainer_image, policy in PULL_DEFAULTS[:3]:
        rendered = yaml.safe_load(yaml.safe_dump(objects(spec.model_copy(update={"image": trainer_image}), flavor)))
        for template in pods(rendered):
            main, *_ = template["spec"]["containers"]
            assert (main["image"], main["imagePullPolicy"]) == (trainer_image, policy)
            ours = [c for c in template["spec"]["initContainers"] if c["name"][0] in "is"]
            assert len(ours) == 2 * len(images)
            assert all(c["imagePullPolicy"] == expected[c["image"]] for c in ours), ours
    # a policy the job sets is every container's
    for template in pods(objects(job(image_pull_policy="Never", image="t:latest",
                                     k8s={"sidecars": [{"name": "s", "image": "x"}]}), flavor)):
        assert {c["imagePullPolicy"] for c in template["spec"]["containers"]
                + [c for c in template["spec"]["initContainers"] if c["name"] == "s"]} == {"Never"}


def test_an_indexed_job_replaces_a_pod_only_once_it_has_failed(crds):
    """Without podReplacementPolicy: Failed the Job controller creates the replacement while
    the evicted pod still writes its SIGTERM checkpoint: two pods of one index at once."""
    for spec in (job(nodes=2, restarts=3), job()):
        [workload_obj] = [o for o in yaml.safe_load_all(k8s.render_k8s(spec, flavor="job")) if o["kind"] == "Job"]
        assert workload_obj["spec"]["podReplacementPolicy"] == "Failed"
        assert [p for p in lint.lint_object(workload_obj, crds) if p.severity == lint.ERROR] == []
