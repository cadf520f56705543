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

import copy
import hashlib
from typing import TYPE_CHECKING

from deploy.k8s import pod as podlib
from deploy.k8s.controller import Pod, Restarts, indexed_job_pods, job_restarts, service_names
from deploy.problems import Problem
from trainer.contract import DEFAULT_PORT

if TYPE_CHECKING:
    from deploy.spec import JobSpec

NAME = "jobset"
KIND = "JobSet"
API_VERSION = "jobset.x-k8s.io/v1alpha2"
PLURAL = "jobsets"
CONTAINER = "trainer"
INSTALLS = "the JobSet controller"
#: The replicated job ddpkit renders (the same name Trainer's runtime uses).
REPLICATED_JOB = "node"
RDZV_PORT = DEFAULT_PORT

# jobset api/jobset/v1alpha2/jobset_types.go: labels and annotations on every Job and pod
JOBSET_NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_NAME_KEY = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS_KEY = "jobset.sigs.k8s.io/replicatedjob-replicas"
GLOBAL_REPLICAS_KEY = "jobset.sigs.k8s.io/global-replicas"
JOB_INDEX_KEY = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX_KEY = "jobset.sigs.k8s.io/job-global-index"
JOB_KEY = "jobset.sigs.k8s.io/job-key"
RESTARTS_KEY = "jobset.sigs.k8s.io/restart-attempt"
GROUP_NAME_KEY = "jobset.sigs.k8s.io/group-name"
GROUP_REPLICAS_KEY = "jobset.sigs.k8s.io/group-replicas"
JOB_GROUP_INDEX_KEY = "jobset.sigs.k8s.io/job-group-index"
#: The JobSet pod webhook labels each pod with its spec.priority (pkg/webhooks/pod_webhook.go)
PRIORITY_KEY = "jobset.sigs.k8s.io/priority"
DEFAULT_GROUP = "default"


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


def default(obj: dict) -> dict:
    """The JobSet webhook's defaults (jobset pkg/webhooks/jobset_webhook.go Default): Indexed
    completion mode, pod restartPolicy OnFailure, DNS hostnames and publishNotReadyAddresses on."""
    obj = copy.deepcopy(obj)
    spec = obj.setdefault("spec", {})
    for rjob in spec.get("replicatedJobs") or []:
        jspec = rjob.setdefault("template", {}).setdefault("spec", {})
        jspec.setdefault("completionMode", "Indexed")
        jspec.setdefault("template", {}).setdefault("spec", {}).setdefault("restartPolicy", "OnFailure")
    network = spec.get("network") or {}
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    spec["network"] = network
    return obj


def pods(obj: dict, objects: list[dict], *, override=None) -> list[Pod]:
    """jobset pkg/controllers/jobset_controller.go constructJob: replicated job `r` copy `j` is
    an Indexed Job `<jobset>-<r>-<j>` whose Job and pod template get labelAndAnnotateObject's
    labels and annotations (and the pod webhook's priority label); with network.enableDNSHostnames every pod's subdomain is
    network.subdomain or the JobSet name, a headless Service the controller creates."""
    obj = default(obj)
    meta, spec = obj["metadata"], obj["spec"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    if spec.get("suspend"):
        raise _suspended(name)
    network = spec["network"]
    subdomain = (network.get("subdomain") or name) if network["enableDNSHostnames"] else None
    rjobs = spec.get("replicatedJobs") or []
    global_replicas = sum(int(r.get("replicas", 1)) for r in rjobs)
    found: list[Pod] = []
    global_index = 0
    for rjob in rjobs:
        replicas = int(rjob.get("replicas", 1))
        group = rjob.get("groupName") or DEFAULT_GROUP
        group_replicas = sum(int(r.get("replicas", 1)) for r in rjobs
                             if (r.get("groupName") or DEFAULT_GROUP) == group)
        group_offset = sum(int(r.get("replicas", 1)) for r in rjobs[:rjobs.index(rjob)]
                           if (r.get("groupName") or DEFAULT_GROUP) == group)
        for j in range(replicas):
            job_spec = copy.deepcopy(rjob["template"]["spec"])
            if override is not None:
                override(rjob["name"], job_spec)
            job_name = f"{name}-{rjob['name']}-{j}"
            keys = {JOBSET_NAME_KEY: name, REPLICATED_JOB_NAME_KEY: rjob["name"],
                    RESTARTS_KEY: "0", REPLICATED_JOB_REPLICAS_KEY: str(replicas),
                    GLOBAL_REPLICAS_KEY: str(global_replicas), JOB_INDEX_KEY: str(j),
                    JOB_KEY: hashlib.sha1(f"{namespace}/{job_name}".encode()).hexdigest(),
                    JOB_GLOBAL_INDEX_KEY: str(global_index), GROUP_NAME_KEY: group,
                    GROUP_REPLICAS_KEY: str(group_replicas),
                    JOB_GROUP_INDEX_KEY: str(group_offset + j)}
            made = indexed_job_pods(job_name, namespace, job_spec, first_index=len(found),
                                    labels=keys, annotations=keys, subdomain=subdomain)
            if not job_spec["template"]["spec"].get("priorityClassName"):
                for p in made:  # the Priority admission plugin's 0 (a class's value is the cluster's)
                    p.labels[PRIORITY_KEY] = p.template["metadata"]["labels"][PRIORITY_KEY] = "0"
            if subdomain:
                for p in made:
                    p.template["spec"]["subdomain"] = subdomain
                    p.dns_names = service_names(f"{p.hostname}.{subdomain}", namespace)
            found += made
            global_index += 1
    return found


def _suspended(name: str) -> Exception:
    from deploy.errors import UserError

    return UserError(f"JobSet {name}: suspended (spec.suspend); on a cluster no pod starts until "
                     "it is resumed (e.g. admitted by Kueue), and --docker cannot do that")


def restarts(obj: dict, objects: list[dict]) -> Restarts:
    """After the webhook's defaults: while a replicated job's Job has backoffLimit left
    (Kubernetes' default 6) its failed pod is restarted alone (restartPolicy OnFailure, the
    JobSet default) or replaced (Never), as controller.job_restarts says; when the Job fails,
    failurePolicy.maxRestarts (default 0) recreates every Job of the set. ddpkit renders
    backoffLimit 0, so only the second applies. (--docker emulates the first level that
    applies, not both.)"""
    spec = default(obj)["spec"]
    rjobs = spec.get("replicatedJobs") or [{}]
    job_spec = (rjobs[0].get("template") or {}).get("spec") or {}
    if job_spec.get("backoffLimit") is None or int(job_spec["backoffLimit"]) > 0:
        return job_restarts(job_spec, "the Job's")
    limit = int((spec.get("failurePolicy") or {}).get("maxRestarts", 0))
    return Restarts("gang", limit, (1, 255), f"failurePolicy.maxRestarts {limit}")
