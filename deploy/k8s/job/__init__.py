"""Flavor `job`: an Indexed Job (`batch/v1`) and a headless Service; needs no operator.

Pods are `<name>-<index>` (hostname) in the Service's subdomain, so node 0 is
`<name>-0.<name>:29500`, named by ddpkit in DDPKIT_MASTER_ADDR. Restarts: pods are
`Never`-restarted; the Job controller replaces a failed pod with a new one (same index, same
hostname) and leaves the other pods alone (in DDP they fail their collectives and are replaced
in turn). `restarts: N` is `backoffLimitPerIndex: N` with `maxFailedIndexes: 0`: every node
may fail N times, and the (N+1)-th failure of any node fails the Job (Kubernetes 1.33 GA, beta
on by default since 1.29; verified on the testbed). `backoffLimit: N x nodes` (failed pods of
all indexes) is what a cluster without per-index limits applies; it never binds before the
per-index limit does.

`podReplacementPolicy: Failed`: the controller creates a pod's replacement only once the pod
has failed, not while it is terminating (an eviction, a drain, a preemption: the pod is
writing its SIGTERM checkpoint). With the API default, `TerminatingOrFailed` (when no
podFailurePolicy is set: kubernetes pkg/apis/batch/v1/defaults.go), two pods of one index
would run at once, both writing the checkpoint. Beta and on by default since Kubernetes 1.29,
GA in 1.34; an API server without the feature drops the field. The API server allows only
`Failed` with a podFailurePolicy (pkg/apis/batch/validation validatePodReplacementPolicy;
deploy/kube/core.py), so one added later keeps it valid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deploy.k8s import pod as podlib
from deploy.kube import COMPLETION_INDEX_KEY, pod_selector
from deploy.problems import Problem
from trainer.contract import DEFAULT_PORT

if TYPE_CHECKING:
    from deploy.spec import JobSpec

NAME = "job"
KIND = "Job"
API_VERSION = "batch/v1"
GROUP = API_VERSION.rpartition("/")[0]  # "" for the core group
#: Where the object says it is suspended: what Kueue sets while the job waits in its queue
SUSPEND = ("spec", "suspend")
PLURAL = "jobs"
CONTAINER = "trainer"
INSTALLS = "nothing (built into Kubernetes)"
#: How `ddpkit cancel` deletes the workload: foreground, so that it stays (deletionTimestamp)
#: until its controller's objects and pods are gone, as a name to resubmit under must wait.
DELETE_PROPAGATION = "Foreground"
#: Kinds its controller creates under the workload's own name that `cancel` waits out (none:
#: the foreground deletion waits for them).
NAMED_CHILD_KINDS: tuple[str, ...] = ()
#: Rendezvous port (torchrun's default), where ddpkit names the master itself.
RDZV_PORT = DEFAULT_PORT


def check(job: JobSpec) -> list[Problem]:
    return podlib.common_refusals(job, NAME)


def master_endpoint(job: JobSpec) -> tuple[str, int]:
    return f"{job.name}-0.{job.name}", RDZV_PORT


def backoff_limit(job: JobSpec) -> int:
    return job.restarts * job.nodes.max


def objects(job: JobSpec) -> list[dict]:
    env = podlib.container_env(job, max_restarts=0, master=master_endpoint(job))
    main = podlib.container(job, CONTAINER, env, [{"name": "rdzv", "containerPort": RDZV_PORT}])
    template = podlib.pod_template(job, main, restart_policy="Never", subdomain=job.name)
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": podlib.metadata(job, job.name, podlib.labels(job)),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": pod_selector(job.name),
                 "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}]},
    }
    spec: dict = {"completionMode": "Indexed", "completions": job.nodes.max,
                  "parallelism": job.nodes.max, "backoffLimit": backoff_limit(job),
                  "backoffLimitPerIndex": job.restarts, "maxFailedIndexes": 0,
                  "podReplacementPolicy": "Failed"}
    if podlib.deadline(job) is not None:
        spec["activeDeadlineSeconds"] = podlib.deadline(job)
    if job.k8s.ttl_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = job.k8s.ttl_after_finished
    spec["template"] = template
    workload = {"apiVersion": API_VERSION, "kind": KIND, "metadata": podlib.workload_metadata(job),
                "spec": spec}
    return [service, workload]


def state(obj: dict) -> str:
    """Job conditions (kubernetes pkg/apis/batch/types.go): Complete / SuccessCriteriaMet,
    Failed / FailureTarget, Suspended; between them the pod counts tell running from
    restarting (a pod failed and the replacement is not ready yet)."""
    true = podlib.true_conditions(obj)
    st = obj.get("status") or {}
    if "Complete" in true or "SuccessCriteriaMet" in true:
        return "SUCCEEDED"
    if "Failed" in true or "FailureTarget" in true:
        return "FAILED"
    if "Suspended" in true:
        return "PENDING"
    if st.get("active"):
        return "RESTARTING" if st.get("failed") and not st.get("ready") else "RUNNING"
    return "RESTARTING" if st.get("failed") else "PENDING"


def node_rank(pod: dict, pods: list[dict]) -> int | None:
    """The completion index (annotation, and label since Kubernetes 1.28)."""
    return podlib.completion_index(pod)


__all__ = ["COMPLETION_INDEX_KEY"]
