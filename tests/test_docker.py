"""`ddpkit run --docker` without a daemon: what each controller would do to the rendered pods.

The manifests are the real renderer's output for the examples, parsed back as YAML; the pods,
their environment, DNS names and volumes are what `deploy.run.docker` would hand to
`docker create`. The end-to-end runs are in test_docker_e2e.py.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from deploy.errors import UserError
from deploy.k8s.render import render_objects
from deploy.load import load_job
from deploy.run import docker as dk
from tests.conftest import REPO

QUICK = str(REPO / "examples" / "quickstart-2node.yaml")


def objects_for(path: str = QUICK, flavor: str = "pytorchjob", overrides=()) -> list[dict]:
    job = load_job(path, list(overrides))
    return render_objects(job, flavor=flavor)


def workload_of(objects):
    return next(o for o in objects if o["kind"] != "ConfigMap")


def envs(objects, host_env=None):
    pods = dk.controller_pods(objects)
    return pods, [dk.resolve_env(p, p.spec["containers"][0], objects, host_env or {}) for p in pods]


def plan(objects, tmp_path: Path, host_env=None):
    pods = dk.controller_pods(objects)
    plans = dk.plan_containers(pods, objects, tmp_path, "t0", "net0", host_env or {}, {})
    dk.prepare_mounts(plans)
    return plans


def opt(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_pytorchjob_env_is_the_v1_operators():
    pods, env = envs(objects_for(flavor="pytorchjob"))
    assert [p.name for p in pods] == ["quickstart-2node-master-0", "quickstart-2node-worker-0"]
    for rank, e in enumerate(env):
        assert e["MASTER_ADDR"] == e["PET_MASTER_ADDR"] == "quickstart-2node-master-0"
        assert e["MASTER_PORT"] == e["PET_MASTER_PORT"] == "23456"  # the pytorchjob-port
        assert e["WORLD_SIZE"] == "4"  # pods x nprocPerNode
        assert e["RANK"] == e["PET_NODE_RANK"] == str(rank)  # a pod index, not a process rank
        assert e["PET_NNODES"] == "2" and e["PET_NPROC_PER_NODE"] == "2"
        assert e["PYTHONUNBUFFERED"] == "1"  # envvar.go v1.9.3
        assert e["DDPKIT_JOB_FILE"] == "/etc/ddpkit/job.yaml"


def test_pytorchjob_operator_env_is_appended_after_the_containers_own_and_wins():
    objects = objects_for(flavor="pytorchjob")
    pj = next(o for o in objects if o["kind"] == "PyTorchJob")
    c = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    c["env"].insert(0, {"name": "WORLD_SIZE", "value": "999"})
    pods = dk.controller_pods(objects)
    names = [e["name"] for e in pods[1].template["spec"]["containers"][0]["env"]]
    assert names[0] == "WORLD_SIZE" and names.index("PYTHONUNBUFFERED") > names.index("DDPKIT_JOB_FILE")
    assert dk.resolve_env(pods[1], pods[1].template["spec"]["containers"][0], objects, {})["WORLD_SIZE"] == "4"


def test_pytorchjob_workers_get_the_operators_init_container_and_labels():
    pods = dk.controller_pods(objects_for(flavor="pytorchjob"))
    master, worker = pods
    assert "initContainers" not in master.spec
    assert [c["name"] for c in worker.spec["initContainers"]] == ["init-pytorch"]
    assert "nslookup quickstart-2node-master-0" in worker.spec["initContainers"][0]["command"][2]
    assert master.labels["training.kubeflow.org/job-role"] == "master"
    assert "training.kubeflow.org/job-role" not in worker.labels
    assert worker.labels["training.kubeflow.org/operator-name"] == "pytorchjob-controller"


def test_pytorchjob_pods_are_reachable_by_their_service_names():
    pods = dk.controller_pods(objects_for(flavor="pytorchjob"))
    master = pods[0]
    assert master.hostname == "quickstart-2node-master-0"
    assert master.dns_names == ["quickstart-2node-master-0", "quickstart-2node-master-0.default",
                                "quickstart-2node-master-0.default.svc",
                                "quickstart-2node-master-0.default.svc.cluster.local"]


def test_pytorchjob_master_port_comes_from_the_manifest():
    objects = objects_for(flavor="pytorchjob")
    pj = next(o for o in objects if o["kind"] == "PyTorchJob")
    for rspec in pj["spec"]["pytorchReplicaSpecs"].values():
        rspec["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 12345
    _, env = envs(objects)
    assert {e["MASTER_PORT"] for e in env} == {"12345"}


def test_elastic_pytorchjob_gets_the_rendezvous_env():
    objects = objects_for(str(REPO / "examples" / "elastic.yaml"), "pytorchjob")
    pods, env = envs(objects)
    assert [p.name for p in pods][:2] == ["elastic-ddp-worker-0", "elastic-ddp-worker-1"]
    assert env[0]["PET_NNODES"] == "2:4"
    assert env[0]["PET_RDZV_ENDPOINT"] == "elastic-ddp-worker-0:23456"
    assert env[0]["PET_RDZV_BACKEND"] == "c10d"
    assert "MASTER_ADDR" not in env[0]  # no Master replica: the operator sets none


def test_two_masters_are_rejected_like_the_operator_does():
    objects = objects_for(flavor="pytorchjob")
    pj = next(o for o in objects if o["kind"] == "PyTorchJob")
    pj["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    with pytest.raises(UserError, match="Master replicas must be 1"):
        dk.controller_pods(objects)


def test_trainjob_env_is_the_torch_plugins():
    pods, env = envs(objects_for(flavor="trainjob"))
    assert [(p.hostname, p.subdomain) for p in pods] == [
        ("quickstart-2node-node-0-0", "quickstart-2node"), ("quickstart-2node-node-0-1", "quickstart-2node")]
    for index, e in enumerate(env):
        assert e["PET_NODE_RANK"] == e["JOB_COMPLETION_INDEX"] == str(index)
        assert e["PET_MASTER_ADDR"] == "quickstart-2node-node-0-0.quickstart-2node"
        assert e["PET_MASTER_PORT"] == "29500"
        assert e["PET_NNODES"] == "2" and e["PET_NPROC_PER_NODE"] == "2"
        assert "RANK" not in e and "WORLD_SIZE" not in e  # Trainer v2 sets PET_* only


def _trainjob_with_runtime(trainer: dict, ml_policy: dict, node_resources=None, extra_containers=()):
    """A TrainJob and its own TrainingRuntime (a `node` trainer job, optional extra containers)."""
    node = {"name": "node", "image": "img:1"}
    if node_resources is not None:
        node["resources"] = node_resources
    pod = {"restartPolicy": "OnFailure", "containers": [node, *extra_containers]}
    runtime = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
               "metadata": {"name": "rt", "namespace": "default"},
               "spec": {"mlPolicy": ml_policy, "template": {"spec": {"replicatedJobs": [{
                   "name": "node", "template": {
                       "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                       "spec": {"template": {"spec": pod}}}}]}}}}
    tj = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "tj"},
          "spec": {"runtimeRef": {"name": "rt", "kind": "TrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
                   "trainer": {"image": "img:2", **trainer}}}
    return [runtime, tj]


@pytest.mark.parametrize("trainer, node_resources, nproc", [
    ({"numProcPerNode": 3}, None, "3"),  # spec.trainer wins, GPUs or not
    ({"resourcesPerNode": {"limits": {"nvidia.com/gpu": 2}}}, None, "auto"),  # GPUs: torchrun decides
    ({"resourcesPerNode": {"requests": {"cpu": "3"}, "limits": {"cpu": "8"}}}, None, "3"),  # CPU request
    ({"resourcesPerNode": {"limits": {"cpu": "1500m"}}}, None, "2"),  # else the limit, rounded up
    ({}, {"requests": {"cpu": "4"}}, "4"),  # the runtime's node container when the TrainJob has none
    ({"resourcesPerNode": {"requests": {"memory": "1Gi"}}}, {"requests": {"cpu": "4"}}, "1"),  # at least 1
    ({}, None, "1"),
])
def test_trainjob_nproc_per_node_is_resolved_as_the_torch_plugin_does(trainer, node_resources, nproc):
    """kubeflow/trainer v2.3.0 torch.go EnforceMLPolicy: `auto` stays only with GPUs; otherwise
    getNumCPUPerNode (request, else limit, Quantity.Value rounds up), at least 1."""
    pods, env = envs(_trainjob_with_runtime(trainer, {"torch": {}}, node_resources))
    assert {e["PET_NPROC_PER_NODE"] for e in env} == {nproc}


def test_trainjob_num_nodes_and_env_injection_come_from_the_runtime():
    """newRuntimeInfo: the trainer pod set counts mlPolicy.numNodes unless spec.trainer sets it;
    EnforceMLPolicy upserts PET_* and the master variables into envInjection targets."""
    sidecar = {"name": "probe", "image": "img:1", "env": [{"name": "PET_NNODES", "value": "9"}]}
    policy = {"numNodes": 3, "torch": {"envInjection": {"targets": [{"jobName": "node", "containerNames": ["probe"]}]}}}
    pods, env = envs(_trainjob_with_runtime({}, policy, extra_containers=[sidecar]))
    assert [p.hostname for p in pods] == ["tj-node-0-0", "tj-node-0-1", "tj-node-0-2"]
    assert {e["PET_NNODES"] for e in env} == {"3"}
    for p in pods:
        probe = dk.resolve_env(p, p.spec["containers"][1], [], {})
        assert probe["PET_NNODES"] == "3" and probe["PET_MASTER_ADDR"] == "tj-node-0-0.tj"
        assert probe["PET_NODE_RANK"] == str(p.index) and probe["PET_MASTER_PORT"] == "29500"
    pods, env = envs(_trainjob_with_runtime({"numNodes": 2}, policy, extra_containers=[sidecar]))
    assert len(pods) == 2 and {e["PET_NNODES"] for e in env} == {"2"}
    plain = copy.deepcopy(sidecar)  # not a target: its own env stays
    pods, _ = envs(_trainjob_with_runtime({}, {"numNodes": 1, "torch": {}}, extra_containers=[plain]))
    assert dk.resolve_env(pods[0], pods[0].spec["containers"][1], [], {})["PET_NNODES"] == "9"


def test_jobset_coordinator_exclusive_topology_and_claim_volumes():
    """JobSet v0.12.0 jobset_controller.go labelAndAnnotateObject (coordinator label and
    annotation `<js>-<rjob>-<jobIndex>-<podIndex>.<subdomain>`; exclusive-topology annotation of
    the JobSet, the replicated job's overriding it) and volume_claim_policy.go addVolumes (a
    mounted claim template becomes the PVC `<template>-<jobset>`; an unmounted one does not)."""
    pod = {"restartPolicy": "Never", "containers": [{
        "name": "c", "image": "img:1", "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}]}
    rjob = {"name": "w", "replicas": 2, "template": {"spec": {"parallelism": 1, "completions": 1,
                                                            "template": {"spec": pod}}}}
    ps = copy.deepcopy(rjob)
    ps["name"] = "ps"
    ps["template"]["metadata"] = {"annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "rack",
                                                  "alpha.jobset.sigs.k8s.io/node-selector": "true"}}
    js = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": {"name": "js", "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "zone"}},
          "spec": {"coordinator": {"replicatedJob": "w", "jobIndex": 1}, "network": {"subdomain": "net"},
                   "replicatedJobs": [rjob, ps],
                   "volumeClaimPolicies": [{"templates": [{"metadata": {"name": "cache"}},
                                                          {"metadata": {"name": "unused"}}]}]}}
    pods = dk.controller_pods([js])
    assert [p.name for p in pods] == ["js-w-0-0", "js-w-1-0", "js-ps-0-0", "js-ps-1-0"]
    for p in pods:
        assert p.labels["jobset.sigs.k8s.io/coordinator"] == "js-w-1-0.net"
        assert p.annotations["jobset.sigs.k8s.io/coordinator"] == "js-w-1-0.net"
        assert p.template["metadata"]["labels"]["jobset.sigs.k8s.io/coordinator"] == "js-w-1-0.net"
        assert p.spec["volumes"] == [{"name": "cache", "persistentVolumeClaim": {"claimName": "cache-js"}}]
    assert [p.annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] for p in pods] == ["zone", "zone", "rack", "rack"]
    assert ["alpha.jobset.sigs.k8s.io/node-selector" in p.annotations for p in pods] == [False, False, True, True]
    del js["spec"]["coordinator"], js["metadata"]["annotations"]
    pods = dk.controller_pods([js])
    assert not any("jobset.sigs.k8s.io/coordinator" in p.labels for p in pods)
    assert ["alpha.jobset.sigs.k8s.io/exclusive-topology" in p.annotations for p in pods] == [False, False, True, True]


def test_trainjob_runtime_patch_brings_the_volumes(tmp_path):
    plans = plan(objects_for(flavor="trainjob"), tmp_path)
    args = plans[0].create_args
    assert any(v.endswith(":/etc/ddpkit:ro") for v in opt(args, "--volume"))
    assert opt(args, "--shm-size") == [str(512 * 2**20)]


@pytest.mark.parametrize("flavor", ["jobset", "job"])
def test_indexed_pods_get_completion_index_and_subdomain_names(flavor):
    pods, env = envs(objects_for(flavor=flavor))
    prefix = "quickstart-2node-node-0" if flavor == "jobset" else "quickstart-2node"
    for index, (pod, e) in enumerate(zip(pods, env, strict=True)):
        assert pod.hostname == f"{prefix}-{index}"
        assert e["JOB_COMPLETION_INDEX"] == str(index)
        assert pod.dns_names[0] == f"{prefix}-{index}.quickstart-2node"
        assert pod.dns_names[-1] == f"{prefix}-{index}.quickstart-2node.default.svc.cluster.local"
        assert e["DDPKIT_MASTER_ADDR"] == f"{prefix}-0.quickstart-2node"
        assert "PET_NODE_RANK" not in e  # no operator: trainer.launch reads the index


def test_job_without_its_headless_service_is_unresolvable(tmp_path):
    objects = [o for o in objects_for(flavor="job") if o["kind"] != "Service"]
    pods = dk.controller_pods(objects)
    assert all(p.dns_names == [] for p in pods)
    with pytest.raises(UserError, match="no headless Service named 'quickstart-2node'"):
        plan(objects, tmp_path)


def test_service_selector_must_match_the_pods(tmp_path):
    objects = objects_for(flavor="job")
    svc = next(o for o in objects if o["kind"] == "Service")
    svc["spec"]["selector"] = {"app.kubernetes.io/instance": "someone-else"}
    with pytest.raises(UserError, match="DDPKIT_MASTER_ADDR"):
        plan(objects, tmp_path)


def test_bare_hostname_is_rejected_though_docker_would_resolve_it(tmp_path):
    objects = objects_for(flavor="jobset")
    js = next(o for o in objects if o["kind"] == "JobSet")
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    for item in container["env"]:
        if item["name"] == "DDPKIT_MASTER_ADDR":
            item["value"] = "quickstart-2node-node-0-0"
    with pytest.raises(UserError, match="bare pod hostname"):
        plan(objects, tmp_path)


def test_configmap_volume_holds_the_rendered_job_file(tmp_path):
    objects = objects_for(flavor="job")
    plans = plan(objects, tmp_path)
    mounts = opt(plans[0].create_args, "--volume")
    source = next(m.split(":")[0] for m in mounts if m.endswith(":/etc/ddpkit:ro"))
    written = yaml.safe_load((Path(source) / "job.yaml").read_text())
    assert written == load_job(QUICK).model_dump(mode="json") | {"k8s": written["k8s"]}
    assert written["name"] == "quickstart-2node"


def test_missing_configmap_fails_like_a_pod_stuck_in_container_creating(tmp_path):
    objects = [o for o in objects_for(flavor="job") if o["kind"] != "ConfigMap"]
    with pytest.raises(UserError, match="ConfigMap 'quickstart-2node-job' is not in the manifest"):
        plan(objects, tmp_path)


def test_planning_writes_nothing_before_every_check_passed(tmp_path):
    objects = objects_for(flavor="job")
    pods = dk.controller_pods(objects)
    plans = dk.plan_containers(pods, objects, tmp_path / "run", "t0", "net0", {}, {})
    assert not (tmp_path / "run").exists()
    dk.prepare_mounts(plans)
    assert (tmp_path / "run" / "configmaps" / "quickstart-2node-job" / "job.yaml").is_file()


def test_claims_are_shared_and_empty_dirs_are_per_pod(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(Path(QUICK).read_text() + (
        "volumes:\n"
        "  - {name: runs, claim: runs, mount: /workspace/runs}\n"
        "  - {name: data, host_path: /mnt/data, mount: /data, read_only: true}\n"
        "  - {name: scratch, empty_dir: {}, mount: /scratch}\n"
        "  - {name: fast, empty_dir: {medium: Memory, size_limit: 1Gi}, mount: /fast}\n"))
    plans = plan(objects_for(str(job_file), "pytorchjob"), tmp_path / "run")
    by_target = [{m.split(":")[1]: m for m in opt(p.create_args, "--volume")} for p in plans]
    assert by_target[0]["/workspace/runs"] == by_target[1]["/workspace/runs"]
    assert by_target[0]["/data"].endswith(":ro") and by_target[0]["/data"] == by_target[1]["/data"]
    assert by_target[0]["/scratch"] != by_target[1]["/scratch"]
    assert opt(plans[0].create_args, "--tmpfs") == [f"/fast:rw,size={2**30},mode=1777"]
    shared = Path(by_target[0]["/workspace/runs"].split(":")[0])
    assert shared.is_dir() and shared.stat().st_mode & 0o777 == 0o777  # the image runs as uid 1000


def test_resources_and_grace_period_become_docker_limits(tmp_path):
    args = plan(objects_for(flavor="pytorchjob"), tmp_path)[0].create_args
    assert opt(args, "--memory") == [str(4 * 2**30)]
    assert float(opt(args, "--cpus")[0]) > 0
    assert opt(args, "--stop-timeout") == ["120"]
    assert "--init" in args and opt(args, "--pull") == ["never"]
    assert opt(args, "--entrypoint") == ["python"]


@pytest.mark.parametrize("resource, per_pod", [("nvidia.com/gpu", 2), ("nvidia.com/gpu.shared", 2),
                                               ("nvidia.com/mig-3g.40gb", 1)])
def test_pods_on_one_host_get_their_own_gpus(tmp_path, resource, per_pod):
    """`--gpus N` would give every container host GPUs 0..N-1: two pods would share them."""
    objs = objects_for(flavor="job", overrides=[f"gpus_per_node={per_pod}", f"procs_per_node={per_pod}",
                                                f"gpu_resource={resource}"])
    given = [opt(p.create_args, "--gpus") for p in plan(objs, tmp_path)]
    first = ",".join(map(str, range(per_pod)))
    second = ",".join(map(str, range(per_pod, 2 * per_pod)))
    assert given == [[f'"device={first}"'], [f'"device={second}"']]


def test_rocm_pods_get_the_amd_devices_and_their_own_gpus(tmp_path):
    objs = objects_for(flavor="job", overrides=["gpus_per_node=2", "gpu_resource=amd.com/gpu"])
    for index, p in enumerate(plan(objs, tmp_path)):
        assert "--gpus" not in p.create_args
        assert opt(p.create_args, "--device") == ["/dev/kfd", "/dev/dri"]
        assert opt(p.create_args, "--group-add")[0] == "video"
        assert f"ROCR_VISIBLE_DEVICES={2 * index},{2 * index + 1}" in opt(p.create_args, "--env")


def test_secret_env_comes_from_the_host_or_fails_naming_it(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(Path(QUICK).read_text() +
                        "secret_env: [{name: WANDB_API_KEY, secret: wandb, key: api-key}]\n")
    objects = objects_for(str(job_file), "job")
    with pytest.raises(UserError, match="export WANDB_API_KEY"):
        plan(objects, tmp_path)
    _, env = envs(objects, {"WANDB_API_KEY": "k-123"})
    assert env[0]["WANDB_API_KEY"] == "k-123"


def test_dollar_paren_references_expand_like_the_kubelet():
    env = {"A": "x", "B": "y"}
    assert dk.expand("$(A)-$(B):$(C)", env) == "x-y:$(C)"
    assert dk.expand("$$(A)", env) == "$(A)"


def test_command_and_args_expand_against_the_env(tmp_path):
    # ddpkit escapes a job's own `$(VAR)` (literal on every target), so write the reference
    # into the manifest as a hand-edited one would have it
    objects = objects_for(flavor="pytorchjob", overrides=['command=["sh", "-c", "echo"]'])
    for spec in workload_of(objects)["spec"]["pytorchReplicaSpecs"].values():
        spec["template"]["spec"]["containers"][0]["command"][-1] = "echo $(MASTER_ADDR):$(MASTER_PORT)"
    plans = plan(copy.deepcopy(objects), tmp_path)
    assert opt(plans[1].create_args, "--entrypoint") == ["sh"]
    assert plans[1].argv == ["-c", "echo quickstart-2node-master-0:23456"]


def test_unsupported_volume_type_is_one_clear_error(tmp_path):
    objects = objects_for(flavor="job")
    job = next(o for o in objects if o["kind"] == "Job")
    job["spec"]["template"]["spec"]["volumes"].append({"name": "x", "csi": {"driver": "d"}})
    job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"].append({"name": "x", "mountPath": "/x"})
    with pytest.raises(UserError, match=r"volume 'x' of type \['csi'\] is not supported"):
        plan(objects, tmp_path)


@pytest.mark.parametrize("flavor, scope, limit", [
    # restartPolicy OnFailure, runPolicy.backoffLimit = restarts x nodes + 1, reached by the 3rd
    ("pytorchjob", "pod", 2),
    ("job", "pod", 1),          # backoffLimitPerIndex = restarts: each pod once
    ("jobset", "gang", 1),      # failurePolicy.maxRestarts = restarts: every pod again
    # the torch-distributed runtime has no failurePolicy and no backoffLimit: the JobSet
    # webhook makes its pods OnFailure, and the Job's default backoffLimit 6 is reached by the
    # 6th restart (tests/test_k8s_restarts.py shows each on the testbed)
    ("trainjob", "pod", 5),
])
def test_restart_policy_follows_the_controller(flavor, scope, limit):
    policy = dk.restart_policy(objects_for(flavor=flavor))
    assert (policy.scope, policy.limit) == (scope, limit)
    assert policy.per_pod == (flavor == "job")
    assert policy.allows(1, 0) == (limit > 0) and not policy.allows(1, limit)


def test_exit_code_policy_retries_only_128_to_255():
    objects = objects_for(flavor="pytorchjob")
    for rspec in next(o for o in objects if o["kind"] == "PyTorchJob")["spec"]["pytorchReplicaSpecs"].values():
        rspec["restartPolicy"] = "ExitCode"
    policy = dk.restart_policy(objects)
    assert policy.allows(143, 0) and not policy.allows(1, 0)


def test_capabilities_become_cap_add_and_host_network_is_refused(tmp_path):
    from deploy.load import parse_job

    job = parse_job({"name": "caps", "image": "img:1", "nodes": 2, "checkpoint": {"ephemeral": True}, "k8s": {"flavor": "job", "capabilities": ["IPC_LOCK"]}})
    plans = plan(render_objects(job), tmp_path)
    assert all(opt(p.create_args, "--cap-add") == ["IPC_LOCK"] for p in plans)
    job = parse_job({"name": "hostnet", "image": "img:1", "k8s": {"flavor": "job", "host_network": True}})
    with pytest.raises(UserError, match="hostNetwork is not supported by --docker"):
        plan(render_objects(job), tmp_path)


UPSTREAM = REPO / "tests" / "lint_corpus" / "upstream"


def _torchtune_trainjob(initializer: dict) -> list[dict]:
    """Trainer v2.3.0's own torchtune runtime (dataset and model initializer jobs, a claim they
    share with `node`, which dependsOn both Complete) and a TrainJob of it on CPUs."""
    runtime = yaml.safe_load((UPSTREAM / "trainer__runtimes__torchtune__llama3_2_1B.yaml").read_text())
    tj = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "tt"},
          "spec": {"runtimeRef": {"name": "torchtune-llama3.2-1b"}, "initializer": initializer,
                   "trainer": {"resourcesPerNode": {"requests": {"cpu": "2"}}}}}
    return [runtime, tj]


def test_trainjob_initializer_jobs_run_before_the_trainer_with_the_trainjobs_storage_uri(tmp_path):
    """jobset plugin builder.go Initializer: each initializer ancestor job runs (replicas 1),
    its container gets spec.initializer's storageUri as STORAGE_URI (upserted over the
    runtime's) and env; JobSet dependsOn makes `node` wait for both; the claim is shared."""
    objects = _torchtune_trainjob({"dataset": {"storageUri": "hf://me/data", "env": [{"name": "X", "value": "1"}]}})
    plans = plan(objects, tmp_path)
    pods = [p.pod for p in plans]
    assert [(p.name, p.prefix) for p in pods] == [
        ("tt-node-0-0", "[node 0] "), ("tt-dataset-initializer-0-0", "[dataset-initializer] "),
        ("tt-model-initializer-0-0", "[model-initializer] ")]
    assert pods[0].depends_on == [("dataset-initializer", "Complete"), ("model-initializer", "Complete")]
    assert pods[1].depends_on == pods[2].depends_on == []
    dataset, model = (dk.resolve_env(p, p.spec["containers"][0], objects, {}) for p in pods[1:])
    assert dataset["STORAGE_URI"] == "hf://me/data" and dataset["X"] == "1"
    assert model["STORAGE_URI"] == "hf://meta-llama/Llama-3.2-1B-Instruct"  # no model section: the runtime's
    assert "PET_NNODES" not in dataset  # not an envInjection target
    assert len({str(p.mounts[0].source) for p in plans}) == 1  # PVC initializer-tt, in every pod
    assert plans[0].mounts[0].source.name == "claim-initializer-tt"


def test_trainjob_initializer_secret_ref_is_refused_naming_it(tmp_path):
    objects = _torchtune_trainjob({"model": {"secretRef": {"name": "hf-token"}}})
    with pytest.raises(UserError, match="envFrom Secret 'hf-token'.*cannot read Secrets"):
        plan(objects, tmp_path)


class _FakeRun(dk.DockerRun):
    """DockerRun without a daemon: a started pod exits at once with its `codes` entry."""

    def __init__(self, plans, codes):
        super().__init__(plans, "net0", "t0", out=open("/dev/null", "w"))
        self.codes, self.started = codes, []

    def _start(self, plan):
        self.started.append(plan.pod.name)
        if plan.pod.name in self.codes:
            self.ended.put((plan, self.codes[plan.pod.name], ""))


def _jobset_depending(status: str, probe: bool = False) -> list[dict]:
    first = {"name": "c", "image": "img:1", **({"readinessProbe": {"exec": {"command": ["true"]}}} if probe else {})}
    rjob = lambda name, container, **extra: {"name": name, **extra, "template": {"spec": {  # noqa: E731
        "parallelism": 1, "completions": 1, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}}}
    return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "js"},
             "spec": {"replicatedJobs": [rjob("init", first, replicas=2),
                                         rjob("main", {"name": "c", "image": "img:1"},
                                              dependsOn=[{"name": "init", "status": status}])]}}]


def test_jobset_depends_on_orders_the_starts(tmp_path):
    """depends_on.go dependencyReachedStatus: Complete waits until every Job of the named
    replicated job succeeded; Ready until every one is ready (a probe-less container: started)."""
    plans = plan(_jobset_depending("Complete"), tmp_path)
    run = _FakeRun(plans, {})
    assert run._start_ready(set(), set())[0] == {"ddpkit-t0-js-init-0-0", "ddpkit-t0-js-init-1-0"}
    run._start_ready({"ddpkit-t0-js-init-1-0"}, {"ddpkit-t0-js-init-0-0"})
    assert "js-main-0-0" not in run.started  # one of two Jobs complete: not yet
    run._start_ready(set(), {"ddpkit-t0-js-init-0-0", "ddpkit-t0-js-init-1-0"})
    assert run.started[-1] == "js-main-0-0"
    ready = _FakeRun(plan(_jobset_depending("Ready"), tmp_path), {})
    assert len(ready._start_ready(set(), set())[0]) == 3  # started counts as Ready: all at once
    with pytest.raises(UserError, match="dependsOn init Ready, whose pods have a readinessProbe"):
        dk.controller_pods(_jobset_depending("Ready", probe=True))


def test_a_failed_dependency_leaves_its_dependents_unstarted(tmp_path):
    plans = plan(_jobset_depending("Complete"), tmp_path)
    run = _FakeRun(plans, {"js-init-0-0": 0, "js-init-1-0": 3, "js-main-0-0": 0})
    assert run._supervise() == 3 and "js-main-0-0" not in run.started
    run = _FakeRun(plans, {"js-init-0-0": 0, "js-init-1-0": 0, "js-main-0-0": 0})
    assert run._supervise() == 0 and run.started[-1] == "js-main-0-0"


def test_jobset_nonindexed_job_pods_have_no_index_and_no_stable_name(tmp_path):
    """kubernetes job_controller.go: a NonIndexed Job's pods come from generateName `<job>-`
    (5 characters of rand's alphabet), carry no completion index, and get no spec.hostname, so
    no `<hostname>.<subdomain>` DNS record (EndpointSlice publishes hostnames only for pods
    that set it). Completions unset with parallelism above 1 (a work queue) is refused."""
    objects = _jobset_depending("Complete")
    for rjob in objects[0]["spec"]["replicatedJobs"]:
        rjob["template"]["spec"]["completionMode"] = "NonIndexed"
    pods, env = envs(objects)
    assert all(re.fullmatch(r"js-(init-[01]|main-0)-[bcdfghjklmnpqrstvwxz2456789]{5}", p.name) for p in pods)
    assert all(p.hostname == p.name and p.dns_names == [] for p in pods)
    assert all("batch.kubernetes.io/job-completion-index" not in p.labels for p in pods)
    assert all("JOB_COMPLETION_INDEX" not in e for e in env)
    assert pods[0].labels["batch.kubernetes.io/job-name"] == "js-init-0"
    queue = objects[0]["spec"]["replicatedJobs"][1]["template"]["spec"]
    queue["parallelism"] = 2
    del queue["completions"]
    with pytest.raises(UserError, match="NonIndexed with parallelism 2 and no completions is a work queue"):
        dk.controller_pods(objects)


def test_env_from_a_configmap_of_the_manifest_is_read_before_env(tmp_path):
    objects = _jobset_depending("Complete")
    container = objects[0]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["envFrom"] = [{"configMapRef": {"name": "cm"}, "prefix": "P_"}]
    container["env"] = [{"name": "P_B", "value": "env wins"}]
    objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"A": "1", "B": "2"}})
    _, env = envs(objects)
    assert env[0]["P_A"] == "1" and env[0]["P_B"] == "env wins"
    objects.pop()
    with pytest.raises(UserError, match="envFrom ConfigMap 'cm' is not in the manifest"):
        envs(objects)
