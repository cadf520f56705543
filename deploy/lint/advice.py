"""ddpkit's advice: what the API server accepts but a training job trips over (warnings).

Each rule applies only where it is right: env the PyTorchJob operator overwrites is pointless
in a PyTorchJob and fine in a JobSet, where nobody else sets MASTER_ADDR; torchrun's per-worker
variables matter only to a container that runs ddpkit's `trainer.launch`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from deploy import units
from deploy.k8s import pytorchjob, trainjob
from deploy.kube.finding import join
from trainer.contract import LAUNCH_MODULE, NPROC_PER_NODE_VAR

RULES = {
    "dev-shm": "/dev/shm is a memory-backed emptyDir in a training container that shares memory "
               "between processes (ddpkit's trainer, or several GPUs)",
    "env-owned": "no env var that the operator or the launcher sets is set by hand",
    "env-duplicate": "no env var is set twice in one container (the later one silently wins)",
    "nproc-gpus": "processes per node equal the GPU limit of the training container",
    "restart-policy": "PyTorchJob replicas restart OnFailure or Never (ExitCode ignores backoffLimit)",
    "runtime-restarts": "a TrainJob on torch-distributed knows its pods restart by the runtime's rules",
    "hostnames": "every pod hostname/Service name the controller will create fits in 63 characters",
    "job-subdomain": "an Indexed Job's subdomain is a headless Service in the file selecting its pods",
    "pod-template": "pod templates inside custom resources pass the API server's pod validation",
}

#: What the training operator v1.9 appends to every container of a PyTorchJob (pkg/controller.v1/
#: pytorch/envvar.go, elastic.go, master.go): set by hand, it is overwritten.
PYTORCHJOB_ENV = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT", "WORLD_SIZE", "RANK",
    "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_NNODES", "PET_RDZV_BACKEND", "PET_RDZV_ID",
    "PET_RDZV_CONF", "PET_RDZV_ENDPOINT", "PET_STANDALONE", "PET_MAX_RESTARTS",
})
#: Set by torchrun for each worker; a container running `trainer.launch` with one of them set
#: is taken for a worker already under torchrun (trainer/launch/plan.py).
TORCHRUN_WORKER_ENV = frozenset({"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"})
#: The Job controller's per-pod variable (Indexed Jobs, hence JobSets).
JOB_ENV = frozenset({"JOB_COMPLETION_INDEX"})

Advice = tuple[str, str, str]  # (rule, path, message)

#: Kubeflow Trainer's upstream ClusterTrainingRuntime (deploy/lint/crds/), and what it makes of
#: a failing pod: it sets no restartPolicy, backoffLimit or failurePolicy, and a TrainJob's
#: runtimePatches cannot (Trainer v2.3), so the JobSet webhook's OnFailure and the Job default
#: backoffLimit 6 apply (tests/test_k8s_e2e.py shows it on the testbed).
TORCH_DISTRIBUTED = "torch-distributed"
TORCH_DISTRIBUTED_RESTARTS = (
    "the torch-distributed runtime restarts a failed pod in place up to 5 times (OnFailure; the Job "
    "default backoffLimit 6 is reached by the 6th restart) and then fails the TrainJob, whatever the "
    "job's own restart setting (ddpkit's `restarts` is torchrun's --max-restarts inside each pod); "
    "for other pod restarts, refer to a ClusterTrainingRuntime that sets them")


def pod_templates(obj: dict) -> Iterator[tuple[str, dict, str | None]]:
    """(path, pod template, role) of every pod template a training kind holds."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "PyTorchJob":
        for role, rspec in (spec.get("pytorchReplicaSpecs") or {}).items():
            if isinstance((rspec or {}).get("template"), dict):
                yield f"spec.pytorchReplicaSpecs[{role}].template", rspec["template"], role
    elif kind == "JobSet":
        for i, rjob in enumerate(spec.get("replicatedJobs") or []):
            template = (((rjob or {}).get("template") or {}).get("spec") or {}).get("template")
            if isinstance(template, dict):
                yield f"spec.replicatedJobs[{i}].template.spec.template", template, None
    elif kind == "Job":
        if isinstance(spec.get("template"), dict):
            yield "spec.template", spec["template"], None
    elif kind == "TrainJob":
        for i, patch in enumerate(spec.get("runtimePatches") or []):
            rjobs = ((((patch or {}).get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
            for j, rjob in enumerate(rjobs):
                template = (((rjob or {}).get("template") or {}).get("spec") or {}).get("template")
                if isinstance(template, dict):
                    yield (f"spec.runtimePatches[{i}].trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
                           ".template.spec.template"), template, None


def training_container(kind: str, pod: dict) -> dict | None:
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    if kind == pytorchjob.KIND:
        return next((c for c in containers if c.get("name") == pytorchjob.CONTAINER), None)
    if kind == trainjob.KIND:
        return next((c for c in containers if c.get("name") == trainjob.CONTAINER), None)
    return containers[0] if containers else None


def runs_trainer_launch(container: dict) -> bool:
    words = [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]
    return LAUNCH_MODULE in words


def runs_torch(kind: str, container: dict) -> bool:
    """A container that trains with PyTorch: the PyTorchJob's `pytorch` one, or one that starts
    torchrun / `torch.distributed.run` / ddpkit's launcher (JobSets and Jobs run anything)."""
    if kind in ("PyTorchJob", "TrainJob"):
        return True  # the operator's `pytorch` container; the torch runtime's `node`
    text = " ".join(str(w) for w in (container.get("command") or []) + (container.get("args") or []))
    return any(word in text for word in ("torchrun", "torch.distributed.run", LAUNCH_MODULE))


def needs_shm(kind: str, container: dict) -> bool:
    """Where the /dev/shm advice is right: a torch training container whose processes share
    memory beyond the pod's 64 MiB: ddpkit's trainer (DataLoader workers hand batches over
    through /dev/shm: trainer/train.py) or more than one GPU (NCCL's intra-node transport).
    A container that runs someone else's script on one GPU or CPU may well not need it
    (upstream's examples), so it gets no advice."""
    if not runs_torch(kind, container):
        return False
    resources = container.get("resources")
    limits = resources.get("limits") if isinstance(resources, dict) else None
    gpus = [units.quantity(v) for k, v in limits.items() if "gpu" in str(k).lower()] if isinstance(limits, dict) else []
    return runs_trainer_launch(container) or any(q is not None and q > 1 for q in gpus)


def _trainjob_trainer(spec: dict) -> dict:
    """spec.trainer as the `node` container the torch plugin makes of it."""
    trainer = spec.get("trainer") if isinstance(spec.get("trainer"), dict) else {}
    return {"command": trainer.get("command"), "args": trainer.get("args"), "resources": trainer.get("resourcesPerNode")}


def advise(obj: dict) -> list[Advice]:
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    found: list[Advice] = []
    if kind == "PyTorchJob":
        for role, rspec in (spec.get("pytorchReplicaSpecs") or {}).items():
            policy = (rspec or {}).get("restartPolicy")
            if policy in ("ExitCode", "Always"):
                found.append(("restart-policy", f"spec.pytorchReplicaSpecs[{role}].restartPolicy",
                              f"{policy} restarts pods without counting them against runPolicy.backoffLimit "
                              "(kubeflow/trainer#2045): a failing job loops forever; use OnFailure"))
    if kind == "TrainJob":
        trainer = spec.get("trainer") or {}
        found += _env(trainer.get("env"), "spec.trainer.env", owned=frozenset(), launch=False)
        ref = spec.get("runtimeRef") or {}
        if ref.get("name") == TORCH_DISTRIBUTED and ref.get("kind", "ClusterTrainingRuntime") == "ClusterTrainingRuntime":
            found.append(("runtime-restarts", "spec.runtimeRef", TORCH_DISTRIBUTED_RESTARTS))
        found += _gpus(trainer.get("resourcesPerNode"), trainer.get("numProcPerNode"), "spec.trainer.resourcesPerNode")
    for path, template, _role in pod_templates(obj):
        pod = template.get("spec") if isinstance(template.get("spec"), dict) else {}
        main = training_container(kind, pod)
        for i, container in enumerate(pod.get("containers") or []):
            if not isinstance(container, dict):
                continue
            cpath = f"{path}.spec.containers[{i}]"
            owned = PYTORCHJOB_ENV if kind == "PyTorchJob" else JOB_ENV if kind in ("Job", "JobSet") else frozenset()
            found += _env(container.get("env"), join(cpath, "env"), owned=owned, launch=runs_trainer_launch(container))
            if container is main:
                found += _gpus(container.get("resources"), _nproc(obj, container), join(cpath, "resources"))
        if main is not None and kind != "TrainJob" and needs_shm(kind, main) and not shm_ok(pod, main):
            found.append(("dev-shm", f"{path}.spec", f"container {main.get('name')!r} has no memory-backed "
                          "emptyDir at /dev/shm (pods get 64 MiB; DataLoader workers die with 'Bus error')"))
    if kind == "TrainJob" and needs_shm(kind, _trainjob_trainer(spec)):
        patched = [t.get("spec") or {} for _, t, _ in pod_templates(obj)]
        if not any(shm_ok(p, training_container("TrainJob", p)) for p in patched):
            found.append(("dev-shm", "spec.runtimePatches", "no memory-backed emptyDir mounted at /dev/shm in "
                          "the trainer pod (unless the runtime has one: pods get 64 MiB otherwise; "
                          "DataLoader workers die with 'Bus error')"))
    return found


def _env(env: Any, path: str, *, owned: frozenset, launch: bool) -> list[Advice]:
    found: list[Advice] = []
    seen: set[str] = set()
    for i, var in enumerate(env if isinstance(env, list) else []):
        name = var.get("name") if isinstance(var, dict) else None
        if not isinstance(name, str):
            continue
        if name in seen:
            found.append(("env-duplicate", f"{path}[{i}]", f"{name} is set twice; the later value silently wins"))
        seen.add(name)
        if name in owned:
            found.append(("env-owned", f"{path}[{i}]", f"{name} is set by the controller, which overwrites it; "
                          "remove it from env"))
        elif launch and name in TORCHRUN_WORKER_ENV:
            found.append(("env-owned", f"{path}[{i}]", f"{name} is torchrun's per-worker variable: trainer.launch "
                          "would take the container for a worker already under torchrun; remove it"))
    return found


def _nproc(obj: dict, container: dict) -> int | None:
    spec = obj.get("spec") or {}
    for value in ((spec.get("elasticPolicy") or {}).get("nProcPerNode"), spec.get("nprocPerNode")):
        if value is not None and str(value).isdigit():
            return int(value)
    for var in container.get("env") or []:
        if isinstance(var, dict) and var.get("name") == NPROC_PER_NODE_VAR and str(var.get("value", "")).isdigit():
            return int(var["value"])
    return None


def _gpus(resources: Any, nproc: Any, path: str) -> list[Advice]:
    if not isinstance(resources, dict) or not isinstance(nproc, int) or isinstance(nproc, bool):
        return []
    limits = resources.get("limits") if isinstance(resources.get("limits"), dict) else {}
    return [("nproc-gpus", f"{path}.limits.{name}", f"{value} GPUs but {nproc} processes per node; torchrun "
             "starts one process per GPU only when they are equal")
            for name, value in sorted(limits.items()) if "gpu" in str(name).lower() and str(value) != str(nproc)]


def shm_ok(pod: dict, container: dict | None) -> bool:
    listed = pod.get("volumes")
    volumes = {v["name"]: v for v in listed if isinstance(v, dict) and isinstance(v.get("name"), str)} \
        if isinstance(listed, list) else {}
    mounts = (container or {}).get("volumeMounts")
    for mount in mounts if isinstance(mounts, list) else []:
        if isinstance(mount, dict) and mount.get("mountPath") == "/dev/shm":
            name = mount.get("name")
            volume = volumes.get(name) if isinstance(name, str) else None
            empty_dir = (volume if isinstance(volume, dict) else {}).get("emptyDir")
            return isinstance(empty_dir, dict) and empty_dir.get("medium") == "Memory"
    return False


def longest_hostname(obj: dict) -> str | None:
    """The longest pod hostname (PyTorchJob: also its Service name) the controller will create."""
    name, spec = (obj.get("metadata") or {}).get("name") or "", obj.get("spec") or {}
    kind = obj.get("kind")
    if kind == "PyTorchJob":
        return max((f"{name}-{role.lower()}-{max(int((r or {}).get('replicas', 1)) - 1, 0)}"
                    for role, r in (spec.get("pytorchReplicaSpecs") or {}).items()), key=len, default=None)
    if kind == "TrainJob":
        return f"{name}-node-0-{max(int((spec.get('trainer') or {}).get('numNodes', 1)) - 1, 0)}"
    return None


def advise_hostnames(obj: dict) -> list[Advice]:
    try:
        longest = longest_hostname(obj)
    except (TypeError, ValueError, AttributeError):
        return []
    if longest and len(longest) > 63:
        return [("hostnames", "metadata.name", f"pod hostname {longest!r} is {len(longest)} characters (at most 63): "
                 "the controller's pods or Services for it will be refused; shorten the name")]
    return []


def advise_file(objects: list) -> list[tuple[int, str, str, str]]:
    """Across the objects of one file: an Indexed Job's subdomain needs its headless Service."""
    found = []
    services = {(o.get("metadata") or {}).get("name"): o for o in objects
                if isinstance(o, dict) and o.get("kind") == "Service"}
    for i, obj in enumerate(objects):
        if not isinstance(obj, dict) or obj.get("kind") != "Job":
            continue
        template = (obj.get("spec") or {}).get("template") or {}
        subdomain = (template.get("spec") or {}).get("subdomain")
        if not subdomain:
            continue
        path = "spec.template.spec.subdomain"
        svc = services.get(subdomain)
        if svc is None:
            found.append((i, "job-subdomain", path, f"no Service {subdomain!r} in this file; "
                          "pods are resolvable only through a headless Service of that name"))
            continue
        sspec = svc.get("spec") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        selector = sspec.get("selector") or {}
        if sspec.get("clusterIP") != "None":
            found.append((i, "job-subdomain", path, f"Service {subdomain!r} is not headless "
                          "(clusterIP: None): pods get no DNS records"))
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            found.append((i, "job-subdomain", path, f"Service {subdomain!r} does not select "
                          "this Job's pods (its selector must match the pod template labels)"))
        if sspec.get("publishNotReadyAddresses") is not True:
            found.append((i, "job-subdomain", path, f"Service {subdomain!r} needs "
                          "publishNotReadyAddresses: true (workers resolve node 0 before it is ready)"))
    return found
