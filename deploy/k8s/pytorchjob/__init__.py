"""Flavor `pytorchjob`: a Kubeflow training-operator v1 PyTorchJob (`kubeflow.org/v1`).

Master (1) + Worker (nodes - 1); elastic `MIN:MAX`: Worker only + elasticPolicy (c10d). The
operator names pods `<name>-<type>-<i>`, each behind a headless Service of the same name, and
gives them PET_* / MASTER_* / RANK / WORLD_SIZE (node 0 is `<name>-master-0:23456`).

Restarts (training-operator pkg/core/job.go PastBackoffLimit): pods are `OnFailure`, so the
kubelet restarts a failed container in place (the other pods are left alone) and the operator
fails the job once the container restart counts of all running pods *reach*
`runPolicy.backoffLimit`. A failed node makes every other node's collectives fail too, and they
restart as well, so one failure of the job costs `nodes` restarts: `restarts: N` renders
`backoffLimit: N x nodes + 1` (N failures of the job, or N x nodes restarts of single pods;
verified on the testbed). `ExitCode` is never
rendered: it recreates pods instead, whose restart counts start at 0 again, so backoffLimit
never stops it (kubeflow/trainer#2045). With `restarts: 0` the pods are `Never` and the first
failure fails the job. Elastic jobs restart inside torchrun (elasticPolicy.maxRestarts =
restarts) and get `backoffLimit: restarts + 1` for the pods.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from deploy.errors import UserError
from deploy.k8s import pod as podlib
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
from deploy.problems import Problem

if TYPE_CHECKING:
    from deploy.spec import JobSpec

NAME = "pytorchjob"
KIND = "PyTorchJob"
API_VERSION = "kubeflow.org/v1"
PLURAL = "pytorchjobs"
INSTALLS = "the Kubeflow training operator (v1)"
#: pkg/apis/kubeflow.org/v1/pytorch_types.go: the container the operator configures, the name
#: of its port and the port its defaulter adds when none is declared.
CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"
PORT = 23456
#: Pod labels the operator sets (common_types.go): replica type (lower case), index within it.
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
OPERATOR_NAME_LABEL = "training.kubeflow.org/operator-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
OPERATOR_NAME = "pytorchjob-controller"
MANAGED_BY = "kubeflow.org/training-operator"
#: The operator's init container on Worker pods when a Master exists (initcontainer.go).
INIT_CONTAINER = "init-pytorch"
INIT_IMAGE = "alpine:3.10"
INIT_MAX_TRIES = 100


def check(job: JobSpec) -> list[Problem]:
    return []


def master_endpoint(job: JobSpec) -> tuple[str, int]:
    role = "worker" if job.nodes.elastic else "master"
    return f"{job.name}-{role}-0", PORT


def backoff_limit(job: JobSpec) -> int:
    """runPolicy.backoffLimit for `restarts` failures of the job: each restarts every node in
    place (one pod for an elastic job, whose other nodes re-rendezvous inside torchrun), and the
    operator fails the job when the restart counts *reach* the limit, hence the + 1."""
    if not job.restarts:
        return 0
    return job.restarts * (1 if job.nodes.elastic else job.nodes.max) + 1


def objects(job: JobSpec) -> list[dict]:
    k8s = job.k8s
    elastic = job.nodes.elastic
    # an elastic PyTorchJob's operator gives only PET_RDZV_ENDPOINT: no master, no node rank
    env_ = podlib.container_env(job, max_restarts=job.restarts if elastic else 0,
                                master=master_endpoint(job) if elastic else None)
    main = podlib.container(job, CONTAINER, env_, [{"name": PORT_NAME, "containerPort": PORT}])
    template = podlib.pod_template(job, main, restart_policy="")
    del template["spec"]["restartPolicy"]  # the replica's restartPolicy decides (the operator warns otherwise)
    restart_policy = "OnFailure" if job.restarts else "Never"
    run_policy: dict = {"cleanPodPolicy": k8s.clean_pod_policy, "backoffLimit": backoff_limit(job)}
    if k8s.ttl_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = k8s.ttl_after_finished
    if podlib.deadline(job) is not None:
        run_policy["activeDeadlineSeconds"] = podlib.deadline(job)
    if k8s.gang:
        policy: dict = {"minAvailable": job.nodes.min}
        if k8s.priority_class:
            policy["priorityClass"] = k8s.priority_class
        run_policy["schedulingPolicy"] = policy
    spec: dict = {"nprocPerNode": str(job.nproc_per_node), "runPolicy": run_policy}
    if elastic:
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": job.nodes.min,
                                 "maxReplicas": job.nodes.max, "maxRestarts": job.restarts}
        roles = [("Worker", job.nodes.max)]
    else:
        roles = [("Master", 1)] + ([("Worker", job.nodes.max - 1)] if job.nodes.max > 1 else [])
    spec["pytorchReplicaSpecs"] = {
        role: {"replicas": n, "restartPolicy": restart_policy, "template": copy.deepcopy(template)}
        for role, n in roles}
    return [{"apiVersion": API_VERSION, "kind": KIND, "metadata": podlib.workload_metadata(job),
             "spec": spec}]


def state(obj: dict) -> str:
    """Conditions Created, Running, Restarting, Succeeded, Failed, Suspended
    (pkg/apis/kubeflow.org/v1/common_types.go); the last one that holds is the current one."""
    true = podlib.true_conditions(obj)
    if "Succeeded" in true:
        return "SUCCEEDED"
    if "Failed" in true:
        return "FAILED"
    last = true[-1] if true else ""
    return {"Running": "RUNNING", "Restarting": "RESTARTING"}.get(last, "PENDING")


def node_rank(pod: dict, pods: list[dict]) -> int | None:
    """Master is 0 and worker i is i + 1 (RANK in envvar.go); without a Master (elastic)
    worker i is i."""
    keys = podlib.pod_keys(pod)
    index = str(keys.get(REPLICA_INDEX_LABEL, ""))
    if not index.isdigit():
        return None
    has_master = any(str(podlib.pod_keys(p).get(REPLICA_TYPE_LABEL, "")).lower() == "master"
                     for p in pods)
    is_worker = str(keys.get(REPLICA_TYPE_LABEL, "")).lower() == "worker"
    return int(index) + (1 if is_worker and has_master else 0)


def default(obj: dict) -> dict:
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
    obj = default(obj)
    meta, spec = obj["metadata"], obj["spec"]
    name, namespace = meta["name"], meta.get("namespace", "default")
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
    total = sum(counts.values())
    nproc_raw = spec.get("nprocPerNode")
    nproc = int(nproc_raw) if str(nproc_raw).isdigit() else 1  # getNprocPerNodeInt
    elastic = spec.get("elasticPolicy")
    has_master = "Master" in replicas

    found = []
    for rtype in ("Master", "Worker"):
        if rtype not in replicas:
            continue
        template = replicas[rtype]["template"]
        for i in range(counts[rtype]):
            rank = i + 1 if rtype == "Worker" and has_master else i
            pod_name = f"{name}-{rtype.lower()}-{i}"
            injected = [env("PYTHONUNBUFFERED", "1")]
            if has_master:
                master, port = f"{name}-master-0", _port(replicas, "Master")
                injected += [env("MASTER_PORT", port), env("PET_MASTER_PORT", port),
                             env("MASTER_ADDR", master), env("PET_MASTER_ADDR", master),
                             env("WORLD_SIZE", total * nproc), env("RANK", rank),
                             env("PET_NODE_RANK", rank)]
            if nproc_raw is not None:
                injected.append(env("PET_NPROC_PER_NODE", nproc_raw))
            if elastic is not None:
                host = elastic.get("rdzvHost") or f"{name}-worker-0"
                port = elastic.get("rdzvPort") or _port(replicas, "Worker")
                injected += [env("PET_RDZV_ENDPOINT", f"{host}:{port}"),
                             env("PET_RDZV_BACKEND", elastic.get("rdzvBackend") or "c10d"),
                             env("PET_NNODES", f"{elastic['minReplicas']}:{elastic['maxReplicas']}")]
                for key, var in (("maxRestarts", "PET_MAX_RESTARTS"), ("nProcPerNode", "PET_NPROC_PER_NODE"),
                                 ("rdzvId", "PET_RDZV_ID")):
                    if elastic.get(key) is not None:
                        injected.append(env(var, elastic[key]))
                if elastic.get("rdzvConf"):
                    injected.append(env("PET_RDZV_CONF", ",".join(
                        f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])))
                if elastic.get("standalone"):
                    injected.append(env("PET_STANDALONE", ""))
            else:
                injected.append(env("PET_NNODES", total))
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
            found.append(Pod(name=pod_name, index=rank, namespace=namespace,
                             hostname=pod_spec.get("hostname") or pod_name,
                             subdomain=pod_spec.get("subdomain"), template=tpl, labels=labels,
                             annotations=template_annotations(template),
                             dns_names=service_names(pod_name, namespace)))
    return found


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
    obj = default(obj)
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
