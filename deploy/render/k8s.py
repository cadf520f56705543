"""Kubernetes manifests for a JobSpec: PyTorchJob, TrainJob, JobSet, or Job + headless Service.

`render_k8s(job, flavor=None, source=...)` returns deterministic multi-document YAML: a
ConfigMap carrying the job file, then the workload (and, for `job`, its Service). It is a pure
function of the JobSpec: no clock, no randomness, no cluster lookups.

Choices, each the same on every flavor unless said otherwise:
- The container runs `python -m trainer.launch` (or `job.command`) with the DDPKIT_* launch
  contract of docs/CONTRACT.md; the job file is the ConfigMap mounted at /etc/ddpkit.
- Restarts belong to Kubernetes: PyTorchJob `backoffLimit` (pods `OnFailure`, because the
  `ExitCode` policy ignores backoffLimit, kubeflow/trainer#2045), JobSet
  `failurePolicy.maxRestarts` (the whole set is recreated), Indexed Job `backoffLimit` =
  restarts x nodes (one failure stops every node's rendezvous). torchrun itself restarts
  (`DDPKIT_MAX_RESTARTS`) only where Kubernetes cannot: elastic PyTorchJobs (elasticPolicy
  maxRestarts) and TrainJobs (the runtime owns the pod's failure policy).
- CPU, memory and GPU requests equal limits (Guaranteed QoS: no surprise eviction of a
  multi-node job; extended resources require it anyway).
- `/dev/shm` is a memory-backed emptyDir sized from `resources.shm` (pods get 64 MiB otherwise).
- Service-mesh sidecars are turned off (they intercept NCCL/gloo traffic).
- A flavor that cannot express something the job asks for is a `Problem` of `check(job, flavor)`
  (deploy/problems.py: `ddpkit validate` reports the same), never a silent drop.
"""

from __future__ import annotations

import json
from typing import Any

from deploy.k8s_names import (
    CONTAINER_NAME,
    FLAVOR_KIND,
    PYTORCHJOB_PORT,
    PYTORCHJOB_PORT_NAME,
    TRAINJOB_NODE,
    TRAINJOB_PORT,
    configmap_name,
    pod_selector,
)
from deploy.problems import Problem, require
from deploy.render import environment
from deploy.spec import JOB_FILE_DIR, JobSpec
from deploy.yamlfile import load_documents

FLAVORS = tuple(FLAVOR_KIND)
JOB_FILE_NAME = "job.yaml"
JOB_FILE_PATH = f"{JOB_FILE_DIR}/{JOB_FILE_NAME}"
#: Rendezvous port on JobSet and Job, where ddpkit names the master itself (torchrun default).
RDZV_PORT = 29500
#: Our entry in TrainJob.spec.runtimePatches (list-map keyed by manager).
PATCH_MANAGER = "ddpkit.io/render"  # Trainer's webhook: a domain-prefixed path
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
DEFAULT_COMMAND = ["python", "-m", "trainer.launch"]
SIDECARS_OFF = {"sidecar.istio.io/inject": "false", "linkerd.io/inject": "disabled"}


# --------------------------------------------------------------------------------------------
# What each flavor can express


def check(job: JobSpec, flavor: str) -> list[Problem]:
    """Everything the job asks that `flavor` cannot say (deploy/problems.py: what `ddpkit
    validate` and the renderer report)."""
    if flavor not in FLAVORS:
        return [Problem("k8s.flavor", f"{flavor!r} is not a flavor", f"use one of {', '.join(FLAVORS)}")]
    problems = []
    k8s = job.k8s
    if job.nodes.elastic and flavor != "pytorchjob":
        problems.append(Problem(
            "nodes", f"elastic {job.nodes} needs the pytorchjob flavor (elasticPolicy); {flavor} "
            "runs a fixed node count", f"set nodes: {job.nodes.max} or --flavor pytorchjob"))
    if k8s.gang and flavor != "pytorchjob" and not k8s.queue:
        problems.append(Problem(
            "k8s.gang", f"the {flavor} flavor is gang-admitted by Kueue",
            "set k8s.queue to a LocalQueue (or use --flavor pytorchjob, schedulingPolicy.minAvailable)"))
    if flavor == "trainjob":
        # Trainer v2.3 runtimePatches: pod metadata, nodeSelector, tolerations, serviceAccount,
        # imagePullSecrets, terminationGracePeriodSeconds, volumes and container env/mounts.
        unsupported = {
            "k8s.priority_class": k8s.priority_class,
            "k8s.scheduler_name": k8s.scheduler_name,
            "k8s.ttl_after_finished": k8s.ttl_after_finished,
        }
        for field, value in unsupported.items():
            if value is not None:
                problems.append(Problem(
                    field, "a TrainJob cannot set it (Trainer v2.3 runtimePatches have no such "
                    "field)", f"set it in the ClusterTrainingRuntime {k8s.runtime!r} or use "
                    "another flavor"))
        if job.image_pull_policy != "IfNotPresent":
            problems.append(Problem(
                "image_pull_policy", "a TrainJob cannot set imagePullPolicy",
                "leave it IfNotPresent (set it in the runtime) or use another flavor"))
    if flavor != "pytorchjob" and k8s.clean_pod_policy != "None":
        problems.append(Problem("k8s.clean_pod_policy", "PyTorchJob only",
                                f"remove it for a {FLAVOR_KIND[flavor]}"))
    return problems


# --------------------------------------------------------------------------------------------
# Shared pieces


def labels(job: JobSpec) -> dict[str, str]:
    """`app.kubernetes.io/*` labels of every object, then the user's."""
    return {
        "app.kubernetes.io/name": "ddpkit",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/managed-by": "ddpkit",
        **job.k8s.labels,
    }


def master_endpoint(job: JobSpec, flavor: str) -> tuple[str, int]:
    """Host and port of node 0 as pods see it (one naming scheme per flavor)."""
    if flavor == "pytorchjob":
        role = "worker" if job.nodes.elastic else "master"
        return f"{job.name}-{role}-0", PYTORCHJOB_PORT
    if flavor == "trainjob":
        return f"{job.name}-{TRAINJOB_NODE}-0-0.{job.name}", TRAINJOB_PORT
    if flavor == "jobset":
        return f"{job.name}-{TRAINJOB_NODE}-0-0.{job.name}", RDZV_PORT
    return f"{job.name}-0.{job.name}", RDZV_PORT


def torchrun_restarts(job: JobSpec, flavor: str) -> int:
    """torchrun --max-restarts: see the module docstring for who restarts what."""
    if flavor == "trainjob" or (flavor == "pytorchjob" and job.nodes.elastic):
        return job.restarts
    return 0


def literal(value: str) -> str:
    """A value Kubernetes passes on as written: it expands `$(VAR)` in env values and commands,
    and `$$` is its escape for `$`. ddpkit's env and command mean the same on every target
    (Slurm exports them verbatim), so every `$` is escaped."""
    return value.replace("$", "$$")


def container_env(job: JobSpec, flavor: str) -> list[dict]:
    """The launch contract first (docs/CONTRACT.md), then the user's env, then secrets."""
    env = [
        {"name": "DDPKIT_JOB_FILE", "value": JOB_FILE_PATH},
        {"name": "DDPKIT_RUN_ID", "value": job.name},
        {"name": "DDPKIT_NNODES", "value": str(job.nodes)},
        {"name": "DDPKIT_NPROC_PER_NODE", "value": str(job.nproc_per_node)},
        {"name": "DDPKIT_MAX_RESTARTS", "value": str(torchrun_restarts(job, flavor))},
        {"name": "DDPKIT_LAUNCHER", "value": "torchrun"},
    ]
    if flavor in ("jobset", "job") or (flavor == "pytorchjob" and job.nodes.elastic):
        # known up front (docs/CONTRACT.md); an elastic PyTorchJob's operator gives only
        # PET_RDZV_ENDPOINT, no master and no node rank
        host, port = master_endpoint(job, flavor)
        env += [{"name": "DDPKIT_MASTER_ADDR", "value": host},
                {"name": "DDPKIT_MASTER_PORT", "value": str(port)}]
    env += [{"name": k, "value": literal(v)} for k, v in job.env.items()]
    env += [{"name": s.name, "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key}}}
            for s in job.secret_env]
    return env


def _cpu(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def container_resources(job: JobSpec) -> dict:
    """Requests equal limits: CPU and memory when set, GPUs when any."""
    amounts: dict[str, Any] = {}
    if job.resources.cpus_per_node is not None:
        amounts["cpu"] = _cpu(job.resources.cpus_per_node)
    if job.resources.memory is not None:
        amounts["memory"] = job.resources.memory
    if job.gpus_per_node:
        amounts[job.gpu_resource] = job.gpus_per_node
    return {"limits": dict(amounts), "requests": dict(amounts)} if amounts else {}


def volumes_and_mounts(job: JobSpec) -> tuple[list[dict], list[dict]]:
    """The job file, /dev/shm, then the user's volumes in order."""
    volumes: list[dict] = [
        {"name": "ddpkit-job", "configMap": {"name": configmap_name(job.name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.resources.shm}},
    ]
    mounts: list[dict] = [
        {"name": "ddpkit-job", "mountPath": JOB_FILE_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    for vol in job.volumes:
        if vol.claim is not None:
            source = {"persistentVolumeClaim": {"claimName": vol.claim}}
            if vol.read_only:
                source["persistentVolumeClaim"]["readOnly"] = True
        elif vol.host_path is not None:
            source = {"hostPath": {"path": vol.host_path, "type": "Directory"}}
        elif vol.nfs is not None:
            source = {"nfs": {"server": vol.nfs.server, "path": vol.nfs.path,
                              "readOnly": vol.read_only}}
        else:
            empty: dict[str, Any] = {}
            if vol.empty_dir.medium:
                empty["medium"] = vol.empty_dir.medium
            if vol.empty_dir.size_limit:
                empty["sizeLimit"] = vol.empty_dir.size_limit
            source = {"emptyDir": empty}
        volumes.append({"name": vol.name, **source})
        mount = {"name": vol.name, "mountPath": vol.mount}
        if vol.read_only:
            mount["readOnly"] = True
        mounts.append(mount)
    return volumes, mounts


def _tolerations(job: JobSpec) -> list[dict]:
    out = []
    for tol in job.k8s.tolerations:
        item = {"key": tol.key, "operator": tol.operator, "value": tol.value, "effect": tol.effect,
                "tolerationSeconds": tol.toleration_seconds}
        out.append({k: v for k, v in item.items() if v is not None})
    return out


def context(job: JobSpec, flavor: str) -> dict[str, Any]:
    """Everything the templates use, computed once from the JobSpec."""
    k8s = job.k8s
    common = labels(job)
    workload = dict(common)
    if k8s.queue:
        workload[KUEUE_QUEUE_LABEL] = k8s.queue
    volumes, mounts = volumes_and_mounts(job)
    restart_policy = "Never"
    if flavor == "pytorchjob" and job.restarts:
        restart_policy = "OnFailure"
    ctx: dict[str, Any] = {
        "name": job.name,
        "namespace": k8s.namespace,
        "labels": common,
        "workload_labels": workload,
        "pod_labels": common,
        "pod_annotations": {**SIDECARS_OFF, **k8s.annotations},
        "configmap_name": configmap_name(job.name),
        "job_file_data": {JOB_FILE_NAME: job.to_yaml()},
        "image": job.image,
        "image_pull_policy": job.image_pull_policy,
        "command": [literal(arg) for arg in job.command or DEFAULT_COMMAND],
        "container_name": CONTAINER_NAME[flavor],
        "env": container_env(job, flavor),
        "resources": container_resources(job),
        "volumes": volumes,
        "volume_mounts": mounts,
        "node_selector": dict(k8s.node_selector),
        "tolerations": _tolerations(job),
        "image_pull_secrets": [{"name": s} for s in k8s.image_pull_secrets],
        "service_account": k8s.service_account,
        "priority_class": k8s.priority_class,
        "scheduler_name": k8s.scheduler_name,
        "termination_grace": k8s.termination_grace,
        "restart_policy": restart_policy,
        "subdomain": None,
        "ports": [],
        "nodes": job.nodes.max,
        "nodes_min": job.nodes.min,
        "nodes_max": job.nodes.max,
        "elastic": job.nodes.elastic,
        "nproc_per_node": job.nproc_per_node,
        "restarts": job.restarts,
        "active_deadline_seconds": job.time_limit,
        "ttl_seconds_after_finished": k8s.ttl_after_finished,
        "clean_pod_policy": k8s.clean_pod_policy,
        "runtime": k8s.runtime,
        "replicated_job": TRAINJOB_NODE,
        "patch_manager": PATCH_MANAGER,
        "master_port": master_endpoint(job, flavor)[1],
    }
    if flavor == "pytorchjob":
        ctx["ports"] = [{"name": PYTORCHJOB_PORT_NAME, "containerPort": PYTORCHJOB_PORT}]
        if job.nodes.elastic:
            ctx["roles"] = [{"name": "Worker", "replicas": job.nodes.max}]
        else:
            ctx["roles"] = [{"name": "Master", "replicas": 1}]
            if job.nodes.max > 1:
                ctx["roles"].append({"name": "Worker", "replicas": job.nodes.max - 1})
        policy: dict[str, Any] = {}
        if k8s.gang:
            policy["minAvailable"] = job.nodes.min
            if k8s.priority_class:
                policy["priorityClass"] = k8s.priority_class
        ctx["scheduling_policy"] = policy
    elif flavor in ("jobset", "job"):
        ctx["ports"] = [{"name": "rdzv", "containerPort": RDZV_PORT}]
    if flavor == "job":
        ctx["subdomain"] = job.name
        ctx["service_name"] = job.name
        ctx["selector"] = pod_selector(job.name)
        ctx["backoff_limit"] = job.restarts * job.nodes.max
    return ctx


# --------------------------------------------------------------------------------------------
# Rendering


def _header(job: JobSpec, flavor: str, source: str) -> str:
    # json.dumps: a file name with a newline cannot break out of the comment
    return (f"# Generated by ddpkit from {json.dumps(str(source))}: job {job.name}, "
            f"flavor {flavor}. Do not edit; re-render instead.\n"
            f"# Apply: ddpkit render k8s {json.dumps(str(source))} --flavor {flavor} "
            "| kubectl apply -f -\n")


def _render(template: str, ctx: dict[str, Any]) -> str:
    return environment("k8s").get_template(template).render(ctx)


def render_k8s(job: JobSpec, *, flavor: str | None = None, source: str = "job.yaml") -> str:
    """Multi-document YAML for `flavor` (default: job.k8s.flavor)."""
    flavor = flavor or job.k8s.flavor
    require(job, "k8s", flavor=flavor)
    ctx = context(job, flavor)
    if flavor != "trainjob":
        ctx["pod_template"] = _render("_pod.yaml.j2", ctx).rstrip("\n")
    docs = [_render("configmap.yaml.j2", ctx),
            _render(f"{flavor}.yaml.j2", ctx)]
    text = _header(job, flavor, source) + "---\n".join(d if d.endswith("\n") else d + "\n" for d in docs)
    objects = parse_objects(text)  # a template bug is ours: fail loudly, never print it
    if any(not isinstance(o, dict) or "kind" not in o for o in objects):
        raise RuntimeError(f"k8s/{flavor}.yaml.j2 rendered something that is not an object")
    return text


def render_objects(job: JobSpec, *, flavor: str | None = None) -> list[dict]:
    """The rendered objects as data (what `kubectl apply` would send)."""
    return parse_objects(render_k8s(job, flavor=flavor))


def parse_objects(text: str) -> list[dict]:
    return load_documents(text)
