"""TrainJob admission, ported from Kubeflow Trainer v2.3.0 `pkg/webhooks/trainjob_webhook.go`
(defaulter and validator), `pkg/runtime/core/{clustertrainingruntime,trainingruntime}.go`
(ValidateObjects: the runtime must exist) and the validation plugins a torch runtime runs
(`pkg/runtime/framework/plugins/torch/torch.go`, `.../jobset/jobset.go`) and the Flux one
(`.../flux/flux.go`).

The validator needs the referenced runtime, which lives in the cluster: lint looks for it among
the linted files, the `--crds` folder (where `kubectl get clustertrainingruntimes -o yaml` can
go) and the bundled upstream `torch-distributed`; a runtime found nowhere is refused, as the
webhook refuses a TrainJob whose runtime is not installed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from deploy import units
from deploy.errors import UserError
from deploy.k8s.controller import (
    Pod,
    Restarts,
    completion_index_env,
    env,
    merge_pod_template,
    upsert_env,
)
from deploy.k8s.jobset import operator as jobset
from deploy.k8s.trainjob import ANCESTOR_LABEL, GROUP, NODE, PORT
from deploy.kube import meta as m
from deploy.kube.finding import Finding

RUNTIME_KINDS = {"ClusterTrainingRuntime", "TrainingRuntime"}
TORCH_RESERVED_ENV = ["PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE"]
DATASET, MODEL = "dataset-initializer", "model-initializer"
INITIALIZER_VOLUME = "initializer"
WEBHOOK_VALIDATION_LABEL = "trainer.kubeflow.org/webhook-validation"
#: pkg/constants/constants.go FluxInstallerContainerName: the init container the Flux plugin adds.
FLUX_INSTALLER = "flux-installer"

#: (kind, name, namespace) -> the runtime object, or None.
RuntimeLookup = Callable[[str, str, str], "dict | None"]


def default(obj: dict) -> None:
    """TrainJobDefaulter.Default on create: every runtime patch gets a `time` (now)."""
    for patch in (obj.get("spec") or {}).get("runtimePatches") or []:
        patch.setdefault("time", "2026-01-01T00:00:00Z")


def validate(obj: dict, find_runtime: RuntimeLookup | None = None) -> list[Finding]:
    spec = obj.get("spec") or {}
    ref = spec.get("runtimeRef") or {}
    kind, group = ref.get("kind", ""), ref.get("apiGroup", "")
    if group != GROUP or kind not in RUNTIME_KINDS:
        return [("", f"unsupported runtime: {kind}.{group}" if group else f"unsupported runtime: {kind}")]
    namespace = (obj.get("metadata") or {}).get("namespace") or "default"
    runtime = find_runtime(kind, ref.get("name", ""), namespace) if find_runtime else None
    if runtime is None:
        what = "clusterTrainingRuntime" if kind == "ClusterTrainingRuntime" else "trainingRuntime"
        return [m.invalid("spec.runtimeRef" if kind == "TrainingRuntime" else "spec.RuntimeRef", ref,
                          f"{kind.lower()}s.{GROUP} \"{ref.get('name')}\" not found: specified {what} "
                          "must be created before the TrainJob is created")]
    runtime_spec = runtime.get("spec") or {}
    template = _merged_template(runtime_spec.get("template") or {}, spec.get("runtimePatches") or [])
    found: list[Finding] = []
    if "torch" in (runtime_spec.get("mlPolicy") or {}):
        found += _validate_torch(obj, runtime_spec, template)
    if "flux" in (runtime_spec.get("mlPolicy") or {}):
        found += _validate_flux(obj, runtime_spec, template)
    found += _validate_jobset_plugin(obj, template)
    return found


def _containers(template: dict) -> dict[str, set[str]]:
    """Container and init-container names per replicated job of a JobSet template."""
    names: dict[str, set[str]] = {}
    for rjob in (template.get("spec") or {}).get("replicatedJobs") or []:
        pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        names[rjob.get("name")] = {c.get("name") for c in (pod.get("initContainers") or []) + (pod.get("containers") or [])}
    return names


def _merged_template(template: dict, patches: list) -> dict:
    """The runtime template with the patches' replicated jobs and containers merged in by name
    (mergeRuntimePatches: a strategic merge patch; both lists merge on `name`)."""
    merged = copy.deepcopy(template)
    rjobs = merged.setdefault("spec", {}).setdefault("replicatedJobs", [])
    for patch in patches:
        for prj in (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []:
            target = next((r for r in rjobs if r.get("name") == prj.get("name")), None)
            if target is None:
                rjobs.append(copy.deepcopy(prj))
                continue
            ppod = (((prj.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            tpod = target.setdefault("template", {}).setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
            for key in ("initContainers", "containers"):
                have = tpod.setdefault(key, [])
                for c in ppod.get(key) or []:
                    if not any(h.get("name") == c.get("name") for h in have):
                        have.append({"name": c.get("name")})
    return merged


def _validate_torch(obj: dict, runtime_spec: dict, template: dict) -> list[Finding]:
    found: list[Finding] = []
    containers = _containers(template)
    injection = ((runtime_spec.get("mlPolicy") or {}).get("torch") or {}).get("envInjection") or {}
    for target in injection.get("targets") or []:
        for cname in target.get("containerNames") or []:
            if cname not in containers.get(target.get("jobName"), set()):
                found.append(m.invalid("spec.runtimeRef", target, f"envInjection target podSet {target.get('jobName')!r} "
                                       f"container {cname!r} not found in runtime template"))
    trainer = (obj.get("spec") or {}).get("trainer")
    if trainer is not None:
        reserved = sorted({e.get("name") for e in trainer.get("env") or []} & set(TORCH_RESERVED_ENV))
        if reserved:
            found.append(m.invalid("spec.trainer.env", trainer.get("env"),
                                   f"must not have reserved envs, invalid envs configured: [{' '.join(reserved)}]"))
    return found


def _validate_flux(obj: dict, runtime_spec: dict, template: dict) -> list[Finding]:
    """The Flux plugin's Validate (pkg/runtime/framework/plugins/flux/flux.go): at least one
    process per node (the TrainJob's numProcPerNode, else the policy's), and no init container
    `flux-installer` in the `node` job (the plugin adds its own)."""
    found: list[Finding] = []
    nproc = ((runtime_spec.get("mlPolicy") or {}).get("flux") or {}).get("numProcPerNode")
    trainer = (obj.get("spec") or {}).get("trainer") or {}
    if trainer.get("numProcPerNode") is not None:
        nproc = trainer["numProcPerNode"]
    if isinstance(nproc, int) and nproc < 1:
        found.append(m.invalid("spec.trainer.numProcPerNode", nproc,
                               "must be greater than or equal to 1 for Flux TrainJob"))
    for rjob in (template.get("spec") or {}).get("replicatedJobs") or []:
        pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        if rjob.get("name") == NODE and any(c.get("name") == FLUX_INSTALLER for c in pod.get("initContainers") or []):
            found.append(m.invalid("spec.trainer.initContainers", FLUX_INSTALLER,
                                   f"InitContainer '{FLUX_INSTALLER}' is reserved"))
    return found


def _validate_jobset_plugin(obj: dict, template: dict) -> list[Finding]:
    spec = obj.get("spec") or {}
    found: list[Finding] = []
    containers = _containers(template)
    for init, what in ((DATASET, "dataset"), (MODEL, "model")):
        # `Initializer.Dataset != nil`: an empty section (`dataset: {}`) asks for the job too
        if (spec.get("initializer") or {}).get(what) is None:
            continue
        if init not in containers:
            found.append(("spec.runtimeRef", f"must have {init} job when trainJob is configured with input {what}Config"))
        elif init not in containers[init]:
            found.append(("spec.runtimeRef", f"must have container with name - {init} in the {init} job"))
        elif not _mounts_initializer(template, init):
            found.append(("spec.runtimeRef", f"must have volumeMount with name - {INITIALIZER_VOLUME} in "
                                             f"container {init} of the {init} job"))
    for patch in spec.get("runtimePatches") or []:
        found += m.is_domain_prefixed_path("spec.runtimePatches.manager", patch.get("manager"))
        for prj in (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []:
            ppod = (((prj.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for c in ppod.get("containers") or []:
                if c.get("env") and c.get("name") in (DATASET, MODEL, NODE):
                    found.append(("spec.runtimePatches", f"must not have envs for the {DATASET}, {MODEL}, {NODE} containers"))
    return found


def _mounts_initializer(template: dict, job: str) -> bool:
    for rjob in (template.get("spec") or {}).get("replicatedJobs") or []:
        if rjob.get("name") != job:
            continue
        pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        for c in pod.get("containers") or []:
            if c.get("name") == job and any(v.get("name") == INITIALIZER_VOLUME for v in c.get("volumeMounts") or []):
                return True
    return False


ANCESTOR_CONTAINER = {"trainer": NODE, MODEL: MODEL, DATASET: DATASET}


def validate_runtime(obj: dict, context: Any = None) -> list[Finding]:
    """(Cluster)TrainingRuntime webhook: `pkg/webhooks/trainingruntime_webhook.go` validateReplicatedJobs.
    Its ValidatingWebhookConfiguration skips a runtime labelled `webhook-validation: disabled`
    (manifests/base/webhook/patch_validating.yaml objectSelector)."""
    if ((obj.get("metadata") or {}).get("labels") or {}).get(WEBHOOK_VALIDATION_LABEL) == "disabled":
        return []
    found: list[Finding] = []
    rjobs = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
    for i, rjob in enumerate(rjobs):
        labels = ((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}
        ancestor = labels.get(ANCESTOR_LABEL)
        if ancestor not in ANCESTOR_CONTAINER:
            continue
        path = f"spec.template.spec.replicatedJobs[{i}]"
        if rjob.get("replicas", 1) != 1:
            found.append(m.invalid(f"{path}.replicas", rjob.get("replicas"), "always must be 1"))
        pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        if not any(c.get("name") == ANCESTOR_CONTAINER[ancestor] for c in pod.get("containers") or []):
            found.append(m.invalid(f"{path}.template.spec.template.spec.containers", "",
                                   f"must contain the required container for the ancestor: {ancestor}"))
    return found


#: The upstream `torch-distributed` ClusterTrainingRuntime (kubeflow/trainer v2.3.0,
#: manifests/base/runtimes/torch_distributed.yaml), reduced to what shapes a pod. Clusters
#: install it; a manifest may also carry its own runtime, which then wins.
TORCH_DISTRIBUTED_RUNTIME = {
    "metadata": {"name": "torch-distributed"},
    "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [{
        "name": NODE,
        # the ancestor label is on the Job template, not on the pods
        "template": {"metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                     "spec": {"template": {"spec": {"containers": [{"name": NODE}]}}}},
    }]}}},
}



def find_runtime(ref: dict, objects: list[dict]) -> dict:
    kind = ref.get("kind", "ClusterTrainingRuntime")
    for obj in objects:
        if obj.get("kind") == kind and obj["metadata"].get("name") == ref.get("name"):
            return obj
    if ref.get("name") == TORCH_DISTRIBUTED_RUNTIME["metadata"]["name"] and kind == "ClusterTrainingRuntime":
        return TORCH_DISTRIBUTED_RUNTIME
    raise UserError(f"TrainJob runtimeRef {kind}/{ref.get('name')}: unknown runtime; --docker "
                    "knows `torch-distributed` or a runtime included in the manifest")



def _runtime_node_resources(runtime_spec: dict) -> dict:
    """ExtractResourcePerNodeFromRuntime: the `node` container's resources in the `node` (or
    trainer-ancestor) job of the runtime."""
    for rjob in ((runtime_spec.get("template") or {}).get("spec") or {}).get("replicatedJobs") or []:
        labels = ((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if rjob.get("name") == NODE or labels.get(ANCESTOR_LABEL) == "trainer":
            pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for c in pod.get("containers") or []:
                if c.get("name") == NODE and c.get("resources") is not None:
                    return c["resources"]
    return {}


def _count(resources: dict, part: str, match: Callable[[str], bool]) -> int:
    """Quantity.Value() (rounded up) of the first resource in `part` whose name matches."""
    for name, value in ((resources or {}).get(part) or {}).items():
        q = units.quantity(value) if match(str(name)) else None
        if q is not None:
            return math.ceil(q)
    return 0


def torch_nproc_per_node(trainer: dict, runtime_spec: dict) -> str:
    """The torch plugin's PET_NPROC_PER_NODE (torch.go EnforceMLPolicy): spec.trainer's
    numProcPerNode; else `auto`, which stays `auto` when the node has GPUs
    (runtime.GetNumGPUPerNode: requests, else limits, of the first resource named *gpu*) and
    otherwise becomes its CPU count (getNumCPUPerNode: the request, else the limit; at least 1).
    The resources are spec.trainer.resourcesPerNode, else the runtime's `node` container's."""
    if trainer.get("numProcPerNode") is not None:
        return str(trainer["numProcPerNode"])
    res = trainer["resourcesPerNode"] if trainer.get("resourcesPerNode") is not None else _runtime_node_resources(runtime_spec)
    gpu = lambda name: "gpu" in name.lower()  # noqa: E731
    if (_count(res, "requests", gpu) or _count(res, "limits", gpu)) > 0:
        return "auto"
    cpus = _count(res, "requests", lambda n: n == "cpu") or _count(res, "limits", lambda n: n == "cpu")
    return str(max(1, cpus))


def torch_num_nodes(trainer: dict, runtime_spec: dict) -> int:
    """PET_NNODES: spec.trainer.numNodes, else the runtime's mlPolicy.numNodes (the trainer pod
    set's count, newRuntimeInfo), else 1."""
    if trainer.get("numNodes") is not None:
        return int(trainer["numNodes"])
    return int((runtime_spec.get("mlPolicy") or {}).get("numNodes") or 1)


def _env_injection(runtime_spec: dict) -> dict[str, set[str]]:
    """mlPolicy.torch.envInjection.targets: replicated job -> container names (regular or init)
    that get the PET_* and master variables too."""
    targets: dict[str, set[str]] = {}
    injection = (((runtime_spec.get("mlPolicy") or {}).get("torch") or {}).get("envInjection") or {})
    for target in injection.get("targets") or []:
        targets.setdefault(target.get("jobName"), set()).update(target.get("containerNames") or [])
    return targets


def _is_trainer_job(rjob: dict) -> bool:
    return (((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL) == "trainer"


def pods(obj: dict, objects: list[dict]) -> list[Pod]:
    """A JobSet named after the TrainJob from its runtime, with spec.runtimePatches merged in
    and spec.trainer's image, command, args and resourcesPerNode on the `node` container of
    the trainer-ancestor job; then the torch plugin (pkg/runtime/framework/plugins/torch/
    torch.go EnforceMLPolicy), when the TrainJob has a spec.trainer, upserts spec.trainer.env,
    then PET_NNODES (torch_num_nodes),
    PET_NPROC_PER_NODE (torch_nproc_per_node), PET_NODE_RANK (fieldRef to the completion
    index), PET_MASTER_ADDR `<trainjob>-node-0-0.<trainjob>` and PET_MASTER_PORT 29500 (an
    entry of the same name is replaced where it stands: PET_* always win), adds port 29500, and
    upserts the same variables into the envInjection targets. The runtime's other jobs run too
    (initializers: `_initializers`), in the order their dependsOn gives (jobset.pods); the
    trainer job's pods are nodes 0.., the others are logged under their job's name."""
    meta, spec = obj["metadata"], obj.get("spec") or {}
    name = meta["name"]
    if spec.get("suspend"):
        raise UserError(f"TrainJob {name}: suspended (spec.suspend); on a cluster no pod starts "
                        "until it is resumed (e.g. admitted by Kueue), and --docker cannot do that")
    trainer = spec.get("trainer") or {}
    runtime = find_runtime(spec.get("runtimeRef") or {}, objects)
    runtime_spec = runtime.get("spec") or {}
    torch = "torch" in (runtime_spec.get("mlPolicy") or {})
    nodes = torch_num_nodes(trainer, runtime_spec)
    pet = [env("PET_NNODES", nodes), env("PET_NPROC_PER_NODE", torch_nproc_per_node(trainer, runtime_spec)),
           completion_index_env("PET_NODE_RANK", "annotations"),
           env("PET_MASTER_ADDR", f"{name}-{NODE}-0-0.{name}"), env("PET_MASTER_PORT", PORT)]
    injection = _env_injection(runtime_spec) if torch else {}
    patches = [p.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {})
               for p in spec.get("runtimePatches") or []]
    trainer_jobs = {r.get("name") for r in (runtime_spec.get("template") or {}).get("spec", {}).get("replicatedJobs") or []
                    if _is_trainer_job(r)} or {NODE}

    def override(rjob_name: str, job_spec: dict) -> None:
        for patch in patches:
            for prj in patch.get("replicatedJobs") or []:
                if prj.get("name") == rjob_name:
                    merge_pod_template(job_spec["template"],
                                       prj.get("template", {}).get("spec", {}).get("template", {}))
        pod_spec = job_spec["template"].setdefault("spec", {})
        for c in [*pod_spec.get("containers", []), *pod_spec.get("initContainers", [])]:
            if c.get("name") in injection.get(rjob_name, ()):
                upsert_env(c, pet)
        if rjob_name in trainer_jobs:  # PET_* on `node` only with a spec.trainer (torch.go:
            # `if trainJob.Spec.Trainer != nil { trainerContainer = ... }`); envInjection: always
            _trainer_job(name, job_spec, trainer, nodes, pet if torch and spec.get("trainer") is not None else [])

    js = {"metadata": {"name": name, "namespace": meta.get("namespace", "default")},
          "spec": copy.deepcopy(runtime_spec["template"]["spec"])}
    _initializers(js["spec"].get("replicatedJobs") or [], spec.get("initializer") or {})
    return _numbered(jobset.pods(js, objects, override=override), trainer_jobs)


def _initializers(rjobs: list[dict], initializer: dict) -> None:
    """The jobset plugin's Builder.Initializer (pkg/runtime/framework/plugins/jobset/builder.go):
    a dataset- or model-initializer ancestor job gets replicas 1, and its container of the same
    name gets spec.initializer.<dataset|model>'s storageUri as STORAGE_URI, then its env
    (both upserted), and its secretRef as an envFrom."""
    for rjob in rjobs:
        ancestor = (((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL)
        if ancestor not in (DATASET, MODEL):
            continue
        rjob["replicas"] = 1
        source = initializer.get("dataset" if ancestor == DATASET else "model")
        pod = rjob["template"].setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
        for c in pod.get("containers") or []:
            if c.get("name") != ancestor or source is None:
                continue
            if source.get("storageUri") is not None:
                upsert_env(c, [env("STORAGE_URI", source["storageUri"])])
            upsert_env(c, source.get("env") or [])
            if (source.get("secretRef") or {}).get("name"):
                c["envFrom"] = [*(c.get("envFrom") or []), {"secretRef": {"name": source["secretRef"]["name"]}}]


def _numbered(pods: list[Pod], trainer_jobs: set[str]) -> list[Pod]:
    """The trainer job's pods are nodes 0.. (their log prefix); the others follow, each logged
    under its replicated job's name (and its place there when the job has several pods)."""
    nodes = [p for p in pods if p.group in trainer_jobs]
    others = [p for p in pods if p.group not in trainer_jobs]
    for i, p in enumerate(nodes + others):
        p.index = i
    for p in others:
        same = [q for q in others if q.group == p.group]
        p.role = p.group if len(same) == 1 else f"{p.group} {same.index(p)}"
    return nodes + others


def _trainer_job(name: str, job_spec: dict, trainer: dict, nodes: int, pet: list[dict]) -> None:
    """The trainer job: its pod count, and spec.trainer and the torch plugin on `node`."""
    pod_spec = job_spec["template"].setdefault("spec", {})
    job_spec["parallelism"] = job_spec["completions"] = nodes
    job_spec.setdefault("completionMode", "Indexed")
    container = next((c for c in pod_spec.get("containers", []) if c.get("name") == NODE), None)
    if container is None:
        raise UserError(f"TrainJob {name}: the runtime has no `{NODE}` container")
    for key in ("image", "command", "args"):
        if key in trainer:
            container[key] = copy.deepcopy(trainer[key])
    if "resourcesPerNode" in trainer:
        container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    upsert_env(container, trainer.get("env") or [])
    if not pet:
        return
    upsert_env(container, pet)
    ports = container.setdefault("ports", [])
    if not any(p.get("containerPort") == PORT for p in ports):
        ports.append({"containerPort": PORT})


def restarts(obj: dict, objects: list[dict]) -> Restarts:
    """The runtime's JobSet decides (jobset.restarts): `torch-distributed` sets neither a
    restartPolicy nor a backoffLimit, so its pods restart in place (OnFailure, the JobSet
    webhook's default) until their restarts reach the Job default backoffLimit 6: 5 restarts,
    whatever `restarts` says (that one is torchrun's --max-restarts inside each pod)."""
    runtime = find_runtime((obj.get("spec") or {}).get("runtimeRef") or {}, objects)
    return jobset.restarts({"spec": runtime["spec"]["template"]["spec"]}, objects)
