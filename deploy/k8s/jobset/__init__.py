"""Flavor `jobset`: a JobSet (`jobset.x-k8s.io/v1alpha2`) of one replicated job `node` with
`nodes` indexed pods; DNS hostnames on.

Pods are `<name>-node-0-<index>` in subdomain `<name>` (a headless Service the JobSet controller
creates), so node 0 is `<name>-node-0-0.<name>:29500`, named by ddpkit in DDPKIT_MASTER_ADDR.
Restarts: `restarts: N` is `failurePolicy.maxRestarts: N`: when a pod fails, its Job fails at
once (inner `backoffLimit: 0`) and the JobSet controller deletes and recreates every Job of the
set (jobset pkg/controllers/failure_policy.go), up to N times; then the JobSet is Failed.
`time_limit` is the inner Job's activeDeadlineSeconds, so it applies to each attempt (JobSet
has no job-wide deadline).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deploy.k8s import pod as podlib
from deploy.problems import Problem
from trainer.contract import DEFAULT_PORT

if TYPE_CHECKING:
    from deploy.spec import JobSpec

NAME = "jobset"
KIND = "JobSet"
API_VERSION = "jobset.x-k8s.io/v1alpha2"
GROUP = API_VERSION.rpartition("/")[0]  # "" for the core group
#: Where the object says it is suspended: what Kueue sets while the job waits in its queue
SUSPEND = ("spec", "suspend")
PLURAL = "jobsets"
CONTAINER = "trainer"
INSTALLS = "the JobSet controller"
#: How `ddpkit cancel` deletes the workload: foreground, so that it stays (deletionTimestamp)
#: until its controller's objects and pods are gone, as a name to resubmit under must wait.
DELETE_PROPAGATION = "Foreground"
#: Kinds its controller creates under the workload's own name that `cancel` waits out (none:
#: the foreground deletion waits for them).
NAMED_CHILD_KINDS: tuple[str, ...] = ()
#: The replicated job ddpkit renders (the same name Trainer's runtime uses).
REPLICATED_JOB = "node"
RDZV_PORT = DEFAULT_PORT


def check(job: JobSpec) -> list[Problem]:
    return podlib.common_refusals(job, NAME)


def master_endpoint(job: JobSpec) -> tuple[str, int]:
    return f"{job.name}-{REPLICATED_JOB}-0-0.{job.name}", RDZV_PORT


def objects(job: JobSpec) -> list[dict]:
    env = podlib.container_env(job, max_restarts=0, master=master_endpoint(job))
    main = podlib.container(job, CONTAINER, env, [{"name": "rdzv", "containerPort": RDZV_PORT}])
    job_spec: dict = {"completionMode": "Indexed", "completions": job.nodes.max,
                      "parallelism": job.nodes.max,
                      # JobSet restarts the whole set (failurePolicy); a failed pod fails its
                      # Job at once.
                      "backoffLimit": 0}
    if podlib.deadline(job) is not None:
        job_spec["activeDeadlineSeconds"] = podlib.deadline(job)
    job_spec["template"] = podlib.pod_template(job, main, restart_policy="Never")
    spec: dict = {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                  "failurePolicy": {"maxRestarts": job.restarts}}
    if job.k8s.ttl_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = job.k8s.ttl_after_finished
    spec["replicatedJobs"] = [{"name": REPLICATED_JOB, "replicas": 1,
                               "template": {"metadata": {"labels": podlib.labels(job)},
                                            "spec": job_spec}}]
    return [{"apiVersion": API_VERSION, "kind": KIND, "metadata": podlib.workload_metadata(job),
             "spec": spec}]


def state(obj: dict) -> str:
    """JobSet conditions (jobset_types.go): Completed, Failed, Suspended, StartupPolicyCompleted;
    `status.restarts` counts recreations of the set."""
    true = podlib.true_conditions(obj)
    st = obj.get("status") or {}
    if "Completed" in true:
        return "SUCCEEDED"
    if "Failed" in true:
        return "FAILED"
    if "Suspended" in true:
        return "PENDING"
    jobs = st.get("replicatedJobsStatus") or []
    active = sum(int(j.get("active", 0) or 0) for j in jobs)
    ready = sum(int(j.get("ready", 0) or 0) for j in jobs)
    if int(st.get("restarts", 0) or 0) > 0 and not ready:
        return "RESTARTING"
    return "RUNNING" if active or ready else "PENDING"


def node_rank(pod: dict, pods: list[dict]) -> int | None:
    """One replicated job of one Job: the completion index."""
    return podlib.completion_index(pod)


