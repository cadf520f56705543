"""What every flavor's pods share: labels, the container's env, resources, volumes, the pod
template, the job-file ConfigMap, and the checks that are the same on every flavor.

Choices (each the same on every flavor unless a flavor module says otherwise):
- The container runs `python -m trainer.launch` (or `job.command`) with the DDPKIT_* launch
  contract of docs/CONTRACT.md; the job file is the ConfigMap mounted at /etc/ddpkit.
- CPU, memory, GPU and extra resources: requests equal limits (Guaranteed QoS: no surprise
  eviction of a multi-node job; extended resources require it anyway).
- `/dev/shm` is a memory-backed emptyDir sized from `resources.shm` (pods get 64 MiB otherwise).
- Service-mesh sidecars are turned off (they intercept NCCL/gloo traffic).

Everything here reads a JobSpec and returns plain data; nothing imports a third-party package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deploy.k8s.names import (
    JOB_FILE_DIR,
    JOB_FILE_NAME,
    JOB_FILE_PATH,
    KUEUE_QUEUE_LABEL,
    common_labels,
    configmap_name,
)
from deploy.problems import Problem

if TYPE_CHECKING:
    from deploy.spec import JobSpec

DEFAULT_COMMAND = ["python", "-m", "trainer.launch"]
SIDECARS_OFF = {"sidecar.istio.io/inject": "false", "linkerd.io/inject": "disabled"}



# --------------------------------------------------------------------------------------------
# Metadata


def labels(job: JobSpec) -> dict[str, str]:
    """Labels of every object and pod: `app.kubernetes.io/*`, then the user's."""
    return {**common_labels(job.name), **job.k8s.labels}


def workload_labels(job: JobSpec) -> dict[str, str]:
    """The workload object's labels: also Kueue's queue label when `k8s.queue` is set."""
    out = labels(job)
    if job.k8s.queue:
        out[KUEUE_QUEUE_LABEL] = job.k8s.queue
    return out


def metadata(job: JobSpec, name: str, labels_: dict[str, str], annotations: dict | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": job.k8s.namespace, "labels": labels_}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def workload_metadata(job: JobSpec) -> dict:
    return metadata(job, job.name, workload_labels(job), getattr(job.k8s, "job_annotations", None))


def configmap(job: JobSpec) -> dict:
    """The job file every pod reads (DDPKIT_JOB_FILE), mounted read-only."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(job, configmap_name(job.name), labels(job)),
            "data": {JOB_FILE_NAME: job.to_yaml()}}


# --------------------------------------------------------------------------------------------
# The container


def literal(value: str) -> str:
    """A value Kubernetes passes on as written: it expands `$(VAR)` in env values and commands,
    and `$$` is its escape for `$`. ddpkit's env and command mean the same on every target
    (Slurm exports them verbatim), so every `$` is escaped."""
    return value.replace("$", "$$")


def container_env(job: JobSpec, *, max_restarts: int, master: tuple[str, int] | None) -> list[dict]:
    """The launch contract first (docs/CONTRACT.md), then the user's env, then secrets.
    `master` is node 0's address where ddpkit names it (the controller does not)."""
    env = [
        {"name": "DDPKIT_JOB_FILE", "value": JOB_FILE_PATH},
        {"name": "DDPKIT_RUN_ID", "value": job.name},
        {"name": "DDPKIT_NNODES", "value": str(job.nodes)},
        {"name": "DDPKIT_NPROC_PER_NODE", "value": str(job.nproc_per_node)},
        {"name": "DDPKIT_MAX_RESTARTS", "value": str(max_restarts)},
        {"name": "DDPKIT_LAUNCHER", "value": "torchrun"},
    ]
    if master is not None:
        env += [{"name": "DDPKIT_MASTER_ADDR", "value": master[0]},
                {"name": "DDPKIT_MASTER_PORT", "value": str(master[1])}]
    env += [{"name": k, "value": literal(v)} for k, v in job.env.items()]
    env += [{"name": s.name, "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key}}}
            for s in job.secret_env]
    return env


def _cpu(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def container_resources(job: JobSpec) -> dict:
    """Requests equal limits: CPU and memory when set, GPUs when any, then extra resources."""
    amounts: dict[str, Any] = {}
    if job.resources.cpus_per_node is not None:
        amounts["cpu"] = _cpu(job.resources.cpus_per_node)
    if job.resources.memory is not None:
        amounts["memory"] = job.resources.memory
    if job.gpus_per_node:
        amounts[job.gpu_resource] = job.gpus_per_node
    amounts.update(getattr(job.k8s, "extra_resources", None) or {})
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
        source: dict[str, Any]
        if vol.claim is not None:
            source = {"persistentVolumeClaim": {"claimName": vol.claim}}
            if vol.read_only:
                source["persistentVolumeClaim"]["readOnly"] = True
        elif vol.host_path is not None:
            source = {"hostPath": {"path": vol.host_path, "type": "Directory"}}
        elif vol.nfs is not None:
            source = {"nfs": {"server": vol.nfs.server, "path": vol.nfs.path,
                              "readOnly": vol.read_only}}
        elif getattr(vol, "secret", None) is not None:
            source = {"secret": {"secretName": vol.secret}}
        elif getattr(vol, "config_map", None) is not None:
            source = {"configMap": {"name": vol.config_map}}
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


def command(job: JobSpec) -> list[str]:
    return [literal(arg) for arg in job.command or DEFAULT_COMMAND]


def container(job: JobSpec, name: str, env: list[dict], ports: list[dict] | None = None) -> dict:
    """The training container (the flavor picks its name, env and ports)."""
    _, mounts = volumes_and_mounts(job)
    out: dict[str, Any] = {"name": name, "image": job.image, "imagePullPolicy": job.image_pull_policy,
                           "command": command(job)}
    if ports:
        out["ports"] = ports
    out["env"] = env
    out["resources"] = container_resources(job)
    out["volumeMounts"] = mounts
    return out


# --------------------------------------------------------------------------------------------
# The pod template


def tolerations(job: JobSpec) -> list[dict]:
    out = []
    for tol in job.k8s.tolerations:
        item = {"key": tol.key, "operator": tol.operator, "value": tol.value, "effect": tol.effect,
                "tolerationSeconds": tol.toleration_seconds}
        out.append({k: v for k, v in item.items() if v is not None})
    return out


def pod_metadata(job: JobSpec) -> dict:
    return {"labels": labels(job), "annotations": {**SIDECARS_OFF, **job.k8s.annotations}}


def pod_template(job: JobSpec, main: dict, *, restart_policy: str, subdomain: str | None = None) -> dict:
    """A pod template (metadata + spec) around the training container `main`."""
    k8s = job.k8s
    spec: dict[str, Any] = {"restartPolicy": restart_policy}
    if subdomain:
        spec["subdomain"] = subdomain
    spec["terminationGracePeriodSeconds"] = k8s.termination_grace
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    if k8s.priority_class:
        spec["priorityClassName"] = k8s.priority_class
    if k8s.scheduler_name:
        spec["schedulerName"] = k8s.scheduler_name
    if k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        spec["tolerations"] = tolerations(job)
    if k8s.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in k8s.image_pull_secrets]
    spec["containers"] = [main]
    spec["volumes"] = volumes_and_mounts(job)[0]
    return {"metadata": pod_metadata(job), "spec": spec}


# --------------------------------------------------------------------------------------------
# What flavors without an operator-specific field cannot express


def common_refusals(job: JobSpec, flavor: str) -> list[Problem]:
    """Refusals shared by the flavors other than `pytorchjob` (which has elasticPolicy,
    schedulingPolicy and cleanPodPolicy)."""
    from deploy.k8s.names import FLAVOR_KIND

    problems: list[Problem] = []
    k8s = job.k8s
    if job.nodes.elastic:
        problems.append(Problem(
            "nodes", f"elastic {job.nodes} needs the pytorchjob flavor (elasticPolicy); {flavor} "
            "runs a fixed node count", f"set nodes: {job.nodes.max} or --flavor pytorchjob"))
    if k8s.gang and not k8s.queue:
        problems.append(Problem(
            "k8s.gang", f"the {flavor} flavor is gang-admitted by Kueue",
            "set k8s.queue to a LocalQueue (or use --flavor pytorchjob, schedulingPolicy.minAvailable)"))
    if k8s.clean_pod_policy != "None":
        problems.append(Problem("k8s.clean_pod_policy", "PyTorchJob only",
                                f"remove it for a {FLAVOR_KIND[flavor]}"))
    return problems


# --------------------------------------------------------------------------------------------
# Reading objects back


def true_conditions(obj: dict) -> list[str]:
    """Types of the status conditions that hold, in the order the controller wrote them."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return [c.get("type", "") for c in conditions if str(c.get("status")) == "True"]


def pod_keys(pod: dict) -> dict[str, str]:
    meta = pod.get("metadata") or {}
    return {**(meta.get("annotations") or {}), **(meta.get("labels") or {})}


def completion_index(pod: dict) -> int | None:
    from deploy.k8s.names import COMPLETION_INDEX_KEY

    index = str(pod_keys(pod).get(COMPLETION_INDEX_KEY, ""))
    return int(index) if index.isdigit() else None
