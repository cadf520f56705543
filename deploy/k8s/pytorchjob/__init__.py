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

from deploy.k8s import pod as podlib
from deploy.problems import Problem

if TYPE_CHECKING:
    from deploy.spec import JobSpec

NAME = "pytorchjob"
KIND = "PyTorchJob"
API_VERSION = "kubeflow.org/v1"
GROUP = API_VERSION.rpartition("/")[0]  # "" for the core group
#: Where the object says it is suspended: what Kueue sets while the job waits in its queue
SUSPEND = ("spec", "runPolicy", "suspend")
PLURAL = "pytorchjobs"
INSTALLS = "the Kubeflow training operator (v1)"
#: How `ddpkit cancel` deletes the workload: foreground, so that it stays (deletionTimestamp)
#: until its controller's objects and pods are gone, as a name to resubmit under must wait.
DELETE_PROPAGATION = "Foreground"
#: Kinds its controller creates under the workload's own name that `cancel` waits out (none:
#: the foreground deletion waits for them).
NAMED_CHILD_KINDS: tuple[str, ...] = ()
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


