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

import re
from typing import TYPE_CHECKING, Any

from deploy import image_forms, units
from deploy.kube import (
    JOB_FILE_DIR,
    JOB_FILE_NAME,
    JOB_FILE_PATH,
    KUEUE_PREFERRED_TOPOLOGY,
    KUEUE_QUEUE_LABEL,
    KUEUE_REQUIRED_TOPOLOGY,
    POD_VOLUMES,
    WORKDIR_MOUNT,
    WORKDIR_VOLUMES,
    common_labels,
    configmap_name,
    pod_selector,
    workdir_configmap_name,
)
from deploy.problems import Problem
from trainer.contract import LAUNCH_ARGV, LaunchEnv

if TYPE_CHECKING:
    from deploy.spec import JobSpec

DEFAULT_COMMAND = list(LAUNCH_ARGV)
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
    return metadata(job, job.name, workload_labels(job), job.k8s.job_annotations)


def configmap(job: JobSpec) -> dict:
    """The job file every pod reads (DDPKIT_JOB_FILE), mounted read-only."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(job, configmap_name(job.name), labels(job)),
            "data": {JOB_FILE_NAME: job.to_yaml()}}


# --------------------------------------------------------------------------------------------
# workdir: the tree as a tar.gz in a ConfigMap, unpacked into an emptyDir before the trainer starts

#: The API server refuses a ConfigMap whose values hold more than 1 MiB (binaryData counted
#: decoded: kubernetes pkg/apis/core/validation ValidateConfigMap, MaxSecretSize); the JSON
#: of the request (base64, 4/3) stays under etcd's 1.5 MiB request limit.
CONFIGMAP_MAX_BYTES = 1024 * 1024
WORKDIR_KEY = "workdir.tar.gz"
WORKDIR_ARCHIVE_DIR = "/etc/ddpkit-workdir"
#: The init container that unpacks it (a name of ddpkit's: `run --docker` runs it too).
WORKDIR_INIT = "ddpkit-workdir"
_WORKDIR, _ARCHIVE = WORKDIR_VOLUMES
#: What unpacks the archive: the job's own image, its python, the standard library only. With
#: more arguments (a TrainJob, which can add no init container), it then runs them in the tree.
UNPACK = """import os, sys, tarfile
archive, into, run = sys.argv[1], sys.argv[2], sys.argv[3:]
with tarfile.open(archive) as tar:
    tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    count = sum(1 for m in tar.getmembers() if not m.isdir())
print(f"ddpkit: workdir sha256:{os.environ.get('DDPKIT_WORKDIR_HASH', '?')[:12]}: {count} files in {into}", flush=True)
if run:
    os.chdir(into)
    os.execvp(run[0], run)
"""


def in_configmap(job: JobSpec) -> bool:
    """The tree ships in a ConfigMap (unpacked by an init container), not in a thin image."""
    return job.workdir is not None and job.workdir.image is None


def trainer_image(job: JobSpec) -> str:
    """The training container's image: the job's, or the thin layer on it that holds the tree."""
    if job.workdir is None or job.workdir.image is None:
        return job.image
    from deploy import workdir

    return workdir.image_of(job)


def workdir_configmap(job: JobSpec) -> dict:
    """The job's workdir as one deterministic tar.gz (deploy/workdir.py), base64 in binaryData;
    its content hash in an annotation."""
    import base64

    from deploy import workdir  # here: a job without a workdir never needs it (render's speed)

    snap = workdir.snapshot(job)
    meta = metadata(job, workdir_configmap_name(job.name), labels(job), {workdir.HASH_ANNOTATION: snap.digest})
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "binaryData": {WORKDIR_KEY: base64.b64encode(snap.archive()).decode("ascii")}}


def workdir_problems(job: JobSpec) -> list[Problem]:
    """A tree whose archive a ConfigMap cannot carry (after the tree's own checks passed)."""
    if not in_configmap(job):
        return []
    from deploy import workdir  # here: a job without a workdir never needs it (render's speed)

    if workdir.problems(job):
        return []
    snap = workdir.snapshot(job)
    size = len(snap.archive())
    if size <= CONFIGMAP_MAX_BYTES:
        return []
    return [Problem("workdir", f"the tree {snap.root} is {workdir.human(size)} as a tar.gz "
                    f"({snap.describe()}), over the {workdir.human(CONFIGMAP_MAX_BYTES)} a ConfigMap "
                    "can carry (the API server's limit)", "leave out what the job does not need "
                    "(workdir.exclude, .gitignore), or ship it as an image layer (workdir.image: "
                    "the repository to push it to)")]


def shipped(job: JobSpec) -> str:
    """What `submit` ships of the workdir, and where (its --dry-run says it too)."""
    from deploy import workdir

    snap = workdir.snapshot(job)
    if not in_configmap(job):
        return f"workdir {snap.root} ({snap.describe()}) as image {trainer_image(job)} (FROM {job.image})"
    return (f"workdir {snap.root} ({snap.describe()}) as a {workdir.human(len(snap.archive()))} "
            f"tar.gz in ConfigMap {job.k8s.namespace}/{workdir_configmap_name(job.name)}")


def workdir_env(job: JobSpec) -> list[dict]:
    """What the launcher records of the tree it runs (trainer/contract.py WORKDIR_*_VAR)."""
    if job.workdir is None:
        return []
    from deploy import workdir

    return [{"name": k, "value": v} for k, v in workdir.record_env(workdir.snapshot(job)).items()]


def unpack_command(job: JobSpec, then: list[str]) -> list[str]:
    """The argv that unpacks the archive into the working directory (then runs `then` there)."""
    return [DEFAULT_COMMAND[0], "-c", UNPACK, f"{WORKDIR_ARCHIVE_DIR}/{WORKDIR_KEY}", WORKDIR_MOUNT, *then]


#: The archive, where the unpacking container reads it.
WORKDIR_ARCHIVE_MOUNT = {"name": _ARCHIVE, "mountPath": WORKDIR_ARCHIVE_DIR, "readOnly": True}


def workdir_init(job: JobSpec) -> dict:
    """The init container that unpacks the tree into the pod's emptyDir: the trainer's image
    and pull policy, its CPU and memory (a pod whose containers all set requests equal to
    limits keeps Guaranteed QoS), the contract's record of the hash."""
    amounts = (container_resources(job).get("limits") or {})
    own = {k: v for k, v in amounts.items() if k in ("cpu", "memory")}
    out: dict[str, Any] = {"name": WORKDIR_INIT, "image": job.image,
                           "imagePullPolicy": pull_policy(job, job.image),
                           "command": unpack_command(job, []), "env": workdir_env(job)}
    if own:
        out["resources"] = {"limits": dict(own), "requests": dict(own)}
    out["volumeMounts"] = [WORKDIR_ARCHIVE_MOUNT, {"name": _WORKDIR, "mountPath": WORKDIR_MOUNT}]
    security = container_security(job)
    if security:
        out["securityContext"] = security
    return out


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
    contract = LaunchEnv(
        job_file=JOB_FILE_PATH, run_id=job.name, nnodes=str(job.nodes), nproc_per_node=job.nproc_per_node,
        max_restarts=max_restarts, launcher="torchrun", stop_grace_s=job.k8s.termination_grace,
        master_addr=master[0] if master else None, master_port=master[1] if master else None)
    env = [{"name": k, "value": v} for k, v in contract.to_env().items()]
    env += workdir_env(job)
    env += [{"name": k, "value": literal(v)} for k, v in job.env.items()]
    env += [{"name": s.name, "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key}}}
            for s in job.secret_env]
    return env


def container_resources(job: JobSpec) -> dict:
    """Requests equal limits: CPU and memory when set, GPUs when any, then extra resources."""
    amounts: dict[str, Any] = {}
    if job.resources.cpus_per_node is not None:
        amounts["cpu"] = units.cpu_quantity(job.resources.cpus_per_node)
    if job.resources.memory is not None:
        amounts["memory"] = job.resources.memory
    if job.gpus_per_node:
        amounts[job.gpu_resource] = job.gpus_per_node
    amounts.update(job.k8s.extra_resources)
    return {"limits": dict(amounts), "requests": dict(amounts)} if amounts else {}


def volumes_and_mounts(job: JobSpec) -> tuple[list[dict], list[dict]]:
    """The job file, /dev/shm, then the user's volumes in order."""
    job_file, shm = POD_VOLUMES
    volumes: list[dict] = [
        {"name": job_file, "configMap": {"name": configmap_name(job.name)}},
        {"name": shm, "emptyDir": {"medium": "Memory", "sizeLimit": job.resources.shm}},
    ]
    mounts: list[dict] = [
        {"name": job_file, "mountPath": JOB_FILE_DIR, "readOnly": True},
        {"name": shm, "mountPath": "/dev/shm"},
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
        elif vol.secret is not None:
            source = {"secret": {"secretName": vol.secret}}
        elif vol.config_map is not None:
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
    if in_configmap(job):  # after the job's own: their indexes stay those of `volumes`
        volumes += [{"name": _WORKDIR, "emptyDir": {}},
                    {"name": _ARCHIVE, "configMap": {"name": workdir_configmap_name(job.name)}}]
        mounts.append({"name": _WORKDIR, "mountPath": WORKDIR_MOUNT})
    return volumes, mounts


def command(job: JobSpec) -> list[str]:
    return [literal(arg) for arg in job.command or DEFAULT_COMMAND]


def pull_policy(job: JobSpec, image: str) -> str:
    """`image_pull_policy` when the job sets it, else Kubernetes' default for `image`
    (deploy/image_forms.py `pull_policy`), written out so the manifest says what runs."""
    return job.image_pull_policy or image_forms.pull_policy(image)


def container(job: JobSpec, name: str, env: list[dict], ports: list[dict] | None = None) -> dict:
    """The training container (the flavor picks its name, env and ports)."""
    _, mounts = volumes_and_mounts(job)
    image = trainer_image(job)
    out: dict[str, Any] = {"name": name, "image": image, "imagePullPolicy": pull_policy(job, image),
                           "command": command(job)}
    if job.workdir is not None:
        out["workingDir"] = WORKDIR_MOUNT
    if ports:
        out["ports"] = ports
    out["env"] = env
    out["resources"] = container_resources(job)
    out["volumeMounts"] = mounts
    security = container_security(job)
    if security:
        out["securityContext"] = security
    return out


def container_security(job: JobSpec) -> dict:
    """The training container's securityContext: added capabilities (IPC_LOCK for RDMA...)."""
    return {"capabilities": {"add": list(job.k8s.capabilities)}} if job.k8s.capabilities else {}


def pod_security(job: JobSpec) -> dict:
    """The pod's securityContext: fsGroup (a PVC writable by the image's user), user, group."""
    k8s = job.k8s
    out = {"runAsUser": k8s.run_as_user, "runAsGroup": k8s.run_as_group, "fsGroup": k8s.fs_group}
    return {k: v for k, v in out.items() if v is not None}


def extra_containers(job: JobSpec) -> list[dict]:
    """Init containers, then sidecars (init containers that keep running: restartPolicy Always,
    Kubernetes 1.29+); each mounts the job's volumes like the trainer."""
    _, mounts = volumes_and_mounts(job)
    out = []
    for c, sidecar in [*((c, False) for c in job.k8s.init_containers), *((c, True) for c in job.k8s.sidecars)]:
        item: dict[str, Any] = {"name": c.name, "image": c.image, "imagePullPolicy": pull_policy(job, c.image)}
        if sidecar:
            item["restartPolicy"] = "Always"
        if c.command:
            item["command"] = [literal(a) for a in c.command]
        if c.args:
            item["args"] = [literal(a) for a in c.args]
        if c.env:
            item["env"] = [{"name": k, "value": literal(v)} for k, v in c.env.items()]
        item["volumeMounts"] = mounts
        out.append(item)
    return out


#: the node label that keeps a job's pods off a node lost under it (`k8s.avoid_lost_nodes`):
#: AVOID_LABEL + the job's name, set by `ddpkit status --watch` (deploy/k8s/blame.py)
AVOID_LABEL = "avoid.ddpkit.io/"


def affinity(job: JobSpec) -> dict:
    """`k8s.avoid_lost_nodes`: only nodes without the job's avoid label; `k8s.one_pod_per_node`:
    never beside another pod of the job."""
    out: dict[str, Any] = {}
    if job.k8s.avoid_lost_nodes:
        out["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": AVOID_LABEL + job.name, "operator": "DoesNotExist"}]}]}}
    if job.k8s.one_pod_per_node:
        out["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": pod_selector(job.name)},
             "topologyKey": "kubernetes.io/hostname"}]}
    return out


def topology_spread(job: JobSpec) -> list[dict]:
    return [{"maxSkew": s.max_skew, "topologyKey": s.topology_key,
             "whenUnsatisfiable": s.when_unsatisfiable,
             "labelSelector": {"matchLabels": pod_selector(job.name)}}
            for s in job.k8s.topology_spread]


# --------------------------------------------------------------------------------------------
# The pod template


#: the taints the node lifecycle controller puts on a node that stopped answering (NoExecute)
NODE_LOST_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def tolerations(job: JobSpec) -> list[dict]:
    """The job's tolerations, then `k8s.node_lost_after` as the NoExecute tolerations of a lost
    node's taints (those the job's own do not name)."""
    own = [tol.as_k8s() for tol in job.k8s.tolerations]
    if job.k8s.node_lost_after is None:
        return own
    named = {t.get("key") for t in own}
    return own + [{"key": key, "operator": "Exists", "effect": "NoExecute",
                   "tolerationSeconds": job.k8s.node_lost_after}
                  for key in NODE_LOST_TAINTS if key not in named]


def pod_metadata(job: JobSpec) -> dict:
    return {"labels": labels(job), "annotations": {**SIDECARS_OFF, **topology(job), **job.k8s.annotations}}


def topology(job: JobSpec) -> dict[str, str]:
    """`k8s.topology` as Kueue's request on the pod template: Kueue gates the pods, finds a
    domain of that level with room for all of them, and assigns nodes in pod-index order
    (the completion index, JobSet's job index, the replica index), which is the node rank."""
    t = job.k8s.topology
    if t is None:
        return {}
    return {KUEUE_REQUIRED_TOPOLOGY if t.required else KUEUE_PREFERRED_TOPOLOGY: t.level}


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
    if tolerations(job):
        spec["tolerations"] = tolerations(job)
    if k8s.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in k8s.image_pull_secrets]
    if k8s.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # else the pod cannot resolve its peers
    if pod_security(job):
        spec["securityContext"] = pod_security(job)
    if affinity(job):
        spec["affinity"] = affinity(job)
    if k8s.topology_spread:
        spec["topologySpreadConstraints"] = topology_spread(job)
    inits = ([workdir_init(job)] if in_configmap(job) else []) + extra_containers(job)
    if inits:
        spec["initContainers"] = inits
    spec["containers"] = [main]
    spec["volumes"] = volumes_and_mounts(job)[0]
    return apply_pod_patch({"metadata": pod_metadata(job), "spec": spec}, job.k8s.pod_patch, main["name"])


# --------------------------------------------------------------------------------------------
# Where a rendered pod field comes from in the job file

#: The job-file field behind a top-level pod spec field that ddpkit fills from one field.
POD_SPEC_SOURCES = {"nodeSelector": "k8s.node_selector", "serviceAccountName": "k8s.service_account",
                    "priorityClassName": "k8s.priority_class", "schedulerName": "k8s.scheduler_name",
                    "imagePullSecrets": "k8s.image_pull_secrets", "volumes": "volumes",
                    "topologySpreadConstraints": "k8s.topology_spread",
                    "terminationGracePeriodSeconds": "k8s.termination_grace"}
_INDEXED = re.compile(r"(\w+)\[(\d+)\](?:\.(\w+))?")
_MOUNT = re.compile(r"(?:initC|c)ontainers\[\d+\]\.volumeMounts\[(\d+)\].*")
_RESOURCE = re.compile(r"containers\[\d+\]\.resources\.(?:limits|requests)\.(.+)")


def job_field(job: JobSpec, path: str) -> str | None:
    """The job-file field that a rendered object's field at `path` (an API server field path,
    `spec....template.spec.tolerations[0].key`) comes from; None when no one field does."""
    _, sep, tail = path.rpartition("template.spec.")
    top = re.match(r"\w*", tail)[0]
    if not sep or not top:
        return None
    if top in (job.k8s.pod_patch.get("spec") or {}):
        return f"k8s.pod_patch.spec.{top}"
    resource = _RESOURCE.fullmatch(tail)
    if resource:
        name = resource[1]
        return (f"k8s.extra_resources.{name}" if name in job.k8s.extra_resources else
                {job.gpu_resource: "gpus_per_node", "cpu": "resources.cpus_per_node"}.get(name, "resources.memory"))
    indexed = _INDEXED.fullmatch(tail)
    if indexed and top == "tolerations" and int(indexed[2]) >= len(job.k8s.tolerations):
        return "k8s.node_lost_after"  # the lost node's tolerations come after the job's own
    if indexed and top == "tolerations":
        snake = re.sub(r"[A-Z]", lambda c: "_" + c[0].lower(), indexed[3] or "")
        return f"k8s.tolerations.{indexed[2]}" + (f".{snake}" if snake else "")
    mount = _MOUNT.fullmatch(tail)
    index = int(mount[1]) if mount else int(indexed[2]) if indexed and top == "volumes" else -1
    if index >= len(POD_VOLUMES) + len(job.volumes):  # the workdir's come after the job's
        return "workdir"
    if index >= len(POD_VOLUMES):  # the job's volumes come after ddpkit's own
        return f"volumes.{index - len(POD_VOLUMES)}"
    return POD_SPEC_SOURCES.get(top)


# --------------------------------------------------------------------------------------------
# k8s.pod_patch

#: Lists merged by a key (Kubernetes' patchMergeKey for these PodSpec/Container fields).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
              "volumes": "name", "env": "name", "volumeMounts": "mountPath",
              "ports": "containerPort", "imagePullSecrets": "name", "hostAliases": "ip",
              "resourceClaims": "name", "readinessGates": "conditionType",
              "schedulingGates": "name", "topologySpreadConstraints": "topologyKey"}
#: What `containers[].name` may say for the training container, whatever the flavor calls it.
TRAINER_ALIAS = "trainer"


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Merge `patch` into `base` the way a strategic merge patch of a pod template does for
    the common cases: mappings merge recursively, `None` removes a key, lists of named things
    (MERGE_KEYS) merge item by item on their key, other lists and scalars replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = strategic_merge({}, v, k) if isinstance(v, dict) else _copy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        return _merge_list(base, patch, key, MERGE_KEYS[key])
    return _copy(patch)


def _merge_list(base: list, patch: list, key: str, field: str) -> list:
    """A list merged on `field`, in the order apimachinery gives it (strategicpatch
    `normalizeElementOrder` + `mergeSortedSlice`): the patch's items in the patch's order, each
    merged with the base item of the same key, and the base-only items slotted in where the
    base order puts them before a patch item, both relative orders kept."""
    def ident(item: Any) -> Any:
        return item.get(field) if isinstance(item, dict) else object()

    base_keys = [ident(i) for i in base]
    patch_keys = {ident(i) for i in patch}
    merged = [strategic_merge(base[base_keys.index(ident(p))], p, key) if ident(p) in base_keys
              else _copy(p) for p in patch]
    left = [_copy(b) for b in base if ident(b) not in patch_keys]  # the base-only items
    out: list = []
    while left and merged:
        li, ri = ident(left[0]), ident(merged[0])
        before = ri in base_keys and base_keys.index(li) < base_keys.index(ri)
        out.append(left.pop(0) if before else merged.pop(0))
    return out + left + merged


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def apply_pod_patch(template: dict, patch: dict, trainer_name: str) -> dict:
    """`k8s.pod_patch` merged into a pod template; `name: trainer` in containers means the
    training container."""
    if not patch:
        return template
    patch = _copy(patch)
    for c in (patch.get("spec") or {}).get("containers") or []:
        if isinstance(c, dict) and c.get("name") == TRAINER_ALIAS:
            c["name"] = trainer_name
    return strategic_merge(template, patch)


def patch_problems(job: JobSpec, trainer_name: str) -> list[Problem]:
    """A container patch that names no container of the pod would add a container without an
    image: the API server refuses it, so say which names exist."""
    problems = []
    names = {trainer_name}
    for i, c in enumerate((job.k8s.pod_patch.get("spec") or {}).get("containers") or []):
        name = trainer_name if c.get("name") == TRAINER_ALIAS else c.get("name")
        if name not in names and "image" not in c:
            problems.append(Problem(f"k8s.pod_patch.spec.containers.{i}.name",
                                    f"no container {c.get('name')!r} in the pod (it has "
                                    f"{', '.join(sorted(names))}) and no image for a new one",
                                    f"name: {TRAINER_ALIAS} patches the training container"))
    return problems


# --------------------------------------------------------------------------------------------
# What flavors without an operator-specific field cannot express


def common_checks(job: JobSpec) -> list[Problem]:
    """What every flavor refuses: Kubernetes-only facts of the job file that cannot work."""
    problems: list[Problem] = []
    k8s = job.k8s
    if job.time_limit is not None and job.time_limit <= k8s.termination_grace:
        problems.append(Problem("time_limit", f"{job.time_limit}s leaves no time to train: pods "
                                f"are stopped k8s.termination_grace ({k8s.termination_grace}s) "
                                "before the limit so their checkpoint is written by then",
                                "raise time_limit or lower k8s.termination_grace"))
    if job.gpu_resource in k8s.extra_resources:
        problems.append(Problem(f"k8s.extra_resources.{job.gpu_resource}", "set by gpus_per_node",
                                "set gpus_per_node instead"))
    if any(r.startswith("hugepages-") for r in k8s.extra_resources) and (
            job.resources.memory is None and job.resources.cpus_per_node is None):
        problems.append(Problem("k8s.extra_resources", "hugepages need a CPU or memory request "
                                "beside them (the API server refuses them alone)",
                                "set resources.memory or resources.cpus_per_node"))
    return problems


def deadline(job: JobSpec) -> int | None:
    """activeDeadlineSeconds: the time limit minus the grace period, so the SIGTERM checkpoint
    is written by the limit (as Slurm's --signal before --time)."""
    return None if job.time_limit is None else job.time_limit - job.k8s.termination_grace


def common_refusals(job: JobSpec, flavor: str) -> list[Problem]:
    """Refusals shared by the flavors other than `pytorchjob` (which has elasticPolicy,
    schedulingPolicy and cleanPodPolicy)."""
    from deploy.kube import FLAVOR_KIND

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
    from deploy.kube import COMPLETION_INDEX_KEY

    index = str(pod_keys(pod).get(COMPLETION_INDEX_KEY, ""))
    return int(index) if index.isdigit() else None
