"""PyTorchJob admission, ported from training-operator v1.9.3 `pkg/webhooks/pytorch/pytorchjob_webhook.go`
and `pkg/common/util/webhooks.go` (ValidateRunPolicy). The operator has no mutating webhook
(its defaults are applied by the controller, after admission), so the validator sees the object
as written plus the CRD's defaults: a Master without `replicas` is refused ("must be 1").
"""

from __future__ import annotations

import copy
from typing import Any

from deploy import kube
from deploy.errors import UserError
from deploy.k8s.controller import (
    Pod,
    Restarts,
    append_env,
    counted_restarts,
    env,
    service_names,
    template_annotations,
    template_labels,
)
from deploy.k8s.pytorchjob import (
    CONTAINER,
    INIT_CONTAINER,
    INIT_IMAGE,
    INIT_MAX_TRIES,
    JOB_NAME_LABEL,
    JOB_ROLE_LABEL,
    MANAGED_BY,
    OPERATOR_NAME,
    OPERATOR_NAME_LABEL,
    PORT,
    PORT_NAME,
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
)
from deploy.kube import meta as m
from deploy.kube.finding import Finding

REPLICA_TYPES = ["Master", "Worker"]
MANAGERS = ["kueue.x-k8s.io/multikueue", "kubeflow.org/training-operator"]
SPECS = "spec.pytorchReplicaSpecs"


def default(obj: dict) -> None:
    """No mutating webhook for PyTorchJob in v1.9."""


def validate(obj: dict, context: Any = None) -> list[Finding]:
    found: list[Finding] = []
    name = (obj.get("metadata") or {}).get("name") or ""
    errs = kube.is_dns1035_label(name)
    if errs:
        found.append(m.invalid("metadata.name", name, f"should match: {','.join(errs)}"))
    spec = obj.get("spec") or {}
    manager = (spec.get("runPolicy") or {}).get("managedBy")
    if manager is not None and manager not in MANAGERS:
        found.append(m.not_supported("spec.runPolicy.managedBy", manager, MANAGERS))
    elastic = spec.get("elasticPolicy")
    specs = spec.get("pytorchReplicaSpecs")
    if elastic is not None:
        if "Worker" not in (specs or {}):
            found.append(m.required(f"{SPECS}[Worker]", "must be configured if elastic policy is used"))
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            found.append(m.forbidden("spec.elasticPolicy.nProcPerNode", "must not be used with spec.nprocPerNode"))
    if specs is None:
        found.append(m.required(SPECS, "must be required"))
    for role, rspec in (specs or {}).items():
        path = f"{SPECS}[{role}]"
        containers_path = f"{path}.template.spec.containers"
        if role not in REPLICA_TYPES:
            found.append(m.not_supported(path, role, REPLICA_TYPES))
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            found.append(m.required(containers_path, "must be specified"))
        for i, container in enumerate(containers):
            if not container.get("image"):
                found.append(m.required(f"{containers_path}[{i}].image", "must be required"))
        if not any(c.get("name") == CONTAINER for c in containers):
            found.append(m.required(containers_path, f"must have at least one container with name {CONTAINER}"))
        replicas = (rspec or {}).get("replicas")
        if role == "Master" and replicas != 1:
            found.append(m.forbidden(f"{path}.replicas", "must be 1"))
        elif role != "Master" and replicas is not None and replicas < 1:
            found.append(m.forbidden(f"{path}.replicas", "must be at least 1"))
    return found


def warnings(obj: dict) -> list[Finding]:
    """The webhook's own admission warnings (returned with a 200; kubectl prints them)."""
    elastic = (obj.get("spec") or {}).get("elasticPolicy") or {}
    if elastic.get("nProcPerNode") is not None:
        return [("spec.elasticPolicy.nProcPerNode",
                 "spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead")]
    return []


def set_defaults(obj: dict) -> dict:
    """SetDefaults_PyTorchJob (pytorch_defaults.go): cleanPodPolicy None, replicas 1,
    restartPolicy OnFailure, the `pytorchjob-port` 23456 on the `pytorch` container, elastic
    min/max from each other or the Worker replicas, nprocPerNode `auto`."""
    obj = copy.deepcopy(obj)
    spec = obj.setdefault("spec", {})
    spec.setdefault("runPolicy", {}).setdefault("cleanPodPolicy", "None")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    for key in list(replicas):
        camel = key[:1].upper() + key[1:].lower()
        if camel in ("Master", "Worker") and camel != key:
            replicas[camel] = replicas.pop(key)
    for r in replicas.values():
        r.setdefault("replicas", 1)
        r.setdefault("restartPolicy", "OnFailure")
        for c in (r.get("template") or {}).get("spec", {}).get("containers") or []:
            if c.get("name") == CONTAINER and not any(
                    p.get("name") == PORT_NAME for p in c.get("ports") or []):
                c.setdefault("ports", []).append({"name": PORT_NAME, "containerPort": PORT})
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        if lo is None and hi is None:
            lo = hi = int((replicas.get("Worker") or {}).get("replicas", 1))
        elastic["minReplicas"] = lo if lo is not None else hi
        elastic["maxReplicas"] = hi if hi is not None else lo
    if elastic is None or elastic.get("nProcPerNode") is None:
        spec.setdefault("nprocPerNode", "auto")
    return obj



def _port(replicas: dict, rtype: str) -> int:
    for c in replicas[rtype]["template"]["spec"].get("containers", []):
        if c.get("name") == CONTAINER:
            for p in c.get("ports") or []:
                if p.get("name") == PORT_NAME:
                    return int(p["containerPort"])
    raise UserError(f"PyTorchJob: {rtype} container {CONTAINER!r} has no port {PORT_NAME!r}")



def pods(obj: dict, objects: list[dict]) -> list[Pod]:
    """pkg/controller.v1/common/pod.go createNewPod + pytorch/envvar.go setPodEnv,
    master.go, elastic.go, initcontainer.go, after the defaulter: pod `<job>-<type>-<i>`
    behind a headless Service of that name (service.go); labels operator-name, job-name,
    replica-type, replica-index and job-role=master (the Master, else Worker 0); the
    replica's restartPolicy (ExitCode becomes Never); and appended to EVERY container's env
    (so it wins over the container's own): PYTHONUNBUFFERED=1; with a Master: MASTER_PORT,
    PET_MASTER_PORT, MASTER_ADDR, PET_MASTER_ADDR, WORLD_SIZE = pods x nprocPerNode (1 unless
    a number), RANK = PET_NODE_RANK = index (+1 for workers); PET_NPROC_PER_NODE; with an
    elasticPolicy PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_NNODES=min:max, PET_MAX_RESTARTS,
    PET_NPROC_PER_NODE, PET_RDZV_ID, PET_RDZV_CONF, PET_STANDALONE, else PET_NNODES = pods.
    Worker pods of a job with a Master get the `init-pytorch` container that waits for the
    Master's DNS name."""
    obj = set_defaults(obj)
    meta, spec = obj["metadata"], obj["spec"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    replicas, counts = _replicas_to_run(name, spec)
    total = sum(counts.values())
    nproc_raw = spec.get("nprocPerNode")
    nproc = int(nproc_raw) if str(nproc_raw).isdigit() else 1  # getNprocPerNodeInt
    has_master = "Master" in replicas
    found = []
    for rtype in ("Master", "Worker"):
        if rtype not in replicas:
            continue
        template = replicas[rtype]["template"]
        for i in range(counts[rtype]):
            rank = i + 1 if rtype == "Worker" and has_master else i
            injected = [env("PYTHONUNBUFFERED", "1")]
            if has_master:
                master, port = f"{name}-master-0", _port(replicas, "Master")
                injected += [env("MASTER_PORT", port), env("PET_MASTER_PORT", port),
                             env("MASTER_ADDR", master), env("PET_MASTER_ADDR", master),
                             env("WORLD_SIZE", total * nproc), env("RANK", rank),
                             env("PET_NODE_RANK", rank)]
            if nproc_raw is not None:
                injected.append(env("PET_NPROC_PER_NODE", nproc_raw))
            injected += _rendezvous_env(name, spec, replicas, total)
            found.append(_pod(name, namespace, rtype, i, rank, template, replicas, injected, has_master))
    return found


def _replicas_to_run(name: str, spec: dict) -> tuple[dict, dict[str, int]]:
    """The replica specs and counts, refused where the operator would refuse or not act."""
    run_policy = spec.get("runPolicy") or {}
    if run_policy.get("suspend"):
        raise UserError(f"PyTorchJob {name}: suspended (runPolicy.suspend); on a cluster no pod "
                        "starts until it is resumed (e.g. admitted by Kueue), and --docker cannot do that")
    if run_policy.get("managedBy") not in (None, MANAGED_BY):
        raise UserError(f"PyTorchJob {name}: runPolicy.managedBy is {run_policy['managedBy']!r}; "
                        "the training operator leaves it to that controller, and --docker cannot "
                        "emulate it")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    unknown = set(replicas) - {"Master", "Worker"}
    if unknown:
        raise UserError(f"PyTorchJob {name}: replica type(s) {sorted(unknown)}: only Master and "
                        "Worker exist")
    counts = {rtype: int(r["replicas"]) for rtype, r in replicas.items()}
    if "Master" in counts and counts["Master"] != 1:
        raise UserError(f"PyTorchJob {name}: Master replicas must be 1 (the operator rejects "
                        f"{counts['Master']})")
    for rtype in replicas:
        if not any(c.get("name") == CONTAINER for c in replicas[rtype]["template"]["spec"].get("containers", [])):
            raise UserError(f"PyTorchJob {name}: {rtype} has no container named {CONTAINER!r}; "
                            "the operator only configures that one")
    return replicas, counts


def _rendezvous_env(name: str, spec: dict, replicas: dict, total: int) -> list[dict]:
    """setPodEnv's elastic part (elastic.go): the c10d endpoint and PET_NNODES=min:max, or
    PET_NNODES = the pod count without an elasticPolicy."""
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        return [env("PET_NNODES", total)]
    host = elastic.get("rdzvHost") or f"{name}-worker-0"
    port = elastic.get("rdzvPort") or _port(replicas, "Worker")
    injected = [env("PET_RDZV_ENDPOINT", f"{host}:{port}"),
                env("PET_RDZV_BACKEND", elastic.get("rdzvBackend") or "c10d"),
                env("PET_NNODES", f"{elastic['minReplicas']}:{elastic['maxReplicas']}")]
    for key, var in (("maxRestarts", "PET_MAX_RESTARTS"), ("nProcPerNode", "PET_NPROC_PER_NODE"),
                     ("rdzvId", "PET_RDZV_ID")):
        if elastic.get(key) is not None:
            injected.append(env(var, elastic[key]))
    if elastic.get("rdzvConf"):
        injected.append(env("PET_RDZV_CONF", ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])))
    if elastic.get("standalone"):
        injected.append(env("PET_STANDALONE", ""))
    return injected


def _pod(name: str, namespace: str, rtype: str, i: int, rank: int, template: dict, replicas: dict,
         injected: list[dict], has_master: bool) -> Pod:
    """createNewPod: the template with the env appended to every container, the init
    container on workers, the replica's restart policy, the operator's labels."""
    pod_name = f"{name}-{rtype.lower()}-{i}"
    tpl = copy.deepcopy(template)
    pod_spec = tpl["spec"]
    for c in pod_spec.get("containers", []):
        append_env(c, injected)
    if has_master and rtype == "Worker":
        pod_spec["initContainers"] = [*(pod_spec.get("initContainers") or []), init_container(name)]
    policy = replicas[rtype]["restartPolicy"]
    pod_spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
    labels = {**template_labels(template), OPERATOR_NAME_LABEL: OPERATOR_NAME,
              JOB_NAME_LABEL: name, REPLICA_TYPE_LABEL: rtype.lower(),
              REPLICA_INDEX_LABEL: str(i)}
    if rtype == "Master" or (not has_master and i == 0):
        labels[JOB_ROLE_LABEL] = "master"
    tpl.setdefault("metadata", {})["labels"] = dict(labels)
    return Pod(name=pod_name, index=rank, namespace=namespace,
               hostname=pod_spec.get("hostname") or pod_name,
               subdomain=pod_spec.get("subdomain"), template=tpl, labels=labels,
               annotations=template_annotations(template),
               dns_names=service_names(pod_name, namespace))



def init_container(job_name: str) -> dict:
    master = f"{job_name}-master-0"
    return {"name": INIT_CONTAINER, "image": INIT_IMAGE, "imagePullPolicy": "IfNotPresent",
            "resources": {"limits": {"cpu": "100m", "memory": "20Mi"},
                          "requests": {"cpu": "50m", "memory": "10Mi"}},
            "command": ["sh", "-c", f"err=1;for i in $(seq {INIT_MAX_TRIES}); do if nslookup "
                        f"{master}; then err=0 && break; fi;echo waiting for master; sleep 2; "
                        "done; exit $err"]}



def restarts(obj: dict, objects: list[dict]) -> Restarts:
    """The replicas' restartPolicy restarts the failed container in place, and the operator
    fails the job when the restart counts of all running pods reach runPolicy.backoffLimit
    (unset: no limit, which --docker reads as 6, the Job default). `ExitCode` pods run `Never`:
    the operator recreates one that failed with 128-255 (IsRetryableExitCode) without any limit
    (a new pod's restart count is 0, so backoffLimit never stops it) and fails the job on any
    other code (verified on the testbed)."""
    obj = set_defaults(obj)
    spec = obj["spec"]
    policies = {r["restartPolicy"] for r in spec["pytorchReplicaSpecs"].values()}
    limit = spec["runPolicy"].get("backoffLimit")
    limit = 6 if limit is None else int(limit)
    source = f"runPolicy.backoffLimit {limit}, restarts of all pods"
    if policies & {"OnFailure", "Always"}:
        return Restarts("pod", counted_restarts(limit), (1, 255), source)
    if "ExitCode" in policies:
        return Restarts("pod", None, (128, 255), "restartPolicy ExitCode: recreated for codes 128-255, "
                        "runPolicy.backoffLimit never reached")
    return Restarts(source="restartPolicy Never")
