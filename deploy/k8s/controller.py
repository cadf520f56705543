"""What Kubernetes controllers make of a workload object: its pods (names, hostnames, DNS names,
labels, annotations, the env the controller injects, init containers) and what happens after
a pod fails. The flavor modules describe their controller with these pieces; `ddpkit run
--docker` runs the result, and the conformance test compares it with the pods the real
controllers create on the testbed.

Env precedence is the kubelet's: a container's `env` list is read in order and a later entry of
the same name wins. Each flavor says where the controller puts its variables (the training
operator appends them after the container's own, Trainer v2 upserts them, the Job controller
appends JOB_COMPLETION_INDEX unless the container already sets it).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

from deploy.errors import UserError
from deploy.kube import COMPLETION_INDEX_KEY

CLUSTER_DOMAIN = "cluster.local"
INDEX_FAILURES_KEY = "batch.kubernetes.io/job-index-failure-count"


@dataclass
class Pod:
    """One pod as the controllers would create it. `template` is the pod template with
    everything the controller changes applied: its containers' env lists are final."""

    name: str
    index: int                      # node rank: what the log prefix shows
    namespace: str
    hostname: str
    subdomain: str | None
    template: dict                  # pod template (metadata + spec), a private copy
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    dns_names: list[str] = field(default_factory=list)
    #: The pod set it belongs to (a JobSet's replicated job) and what it waits for before it is
    #: created: (pod set, "Ready" or "Complete") pairs, as a JobSet's dependsOn.
    group: str = ""
    depends_on: list[tuple[str, str]] = field(default_factory=list)
    #: Log prefix instead of `node <index>` (a pod that is not a training node: an initializer).
    role: str = ""

    @property
    def spec(self) -> dict:
        return self.template.get("spec") or {}

    @property
    def prefix(self) -> str:
        return f"[{self.role}] " if self.role else f"[node {self.index}] "


@dataclass
class Restarts:
    """What the workload's controller does after a pod fails: restart that pod (`pod`), every
    pod (`gang`) or nothing, at most `limit` times in all (`per_pod`: `limit` times for each
    pod, as a Job's backoffLimitPerIndex counts; None: without a limit)."""

    scope: str = "none"
    limit: int | None = 0
    retryable: tuple[int, int] = (1, 255)  # exit codes that may be retried
    source: str = "no restarts"
    per_pod: bool = False

    def allows(self, rc: int, used: int) -> bool:
        return (self.scope != "none" and (self.limit is None or used < self.limit)
                and self.retryable[0] <= rc <= self.retryable[1])


def counted_restarts(backoff_limit: int) -> int:
    """How many in-place restarts a limit on the summed container restart counts allows: the
    Job controller (pastBackoffLimitOnFailure) and the training operator (PastBackoffLimit) fail
    the job when the sum *reaches* the limit (0: at the first restart), so one fewer."""
    return max(backoff_limit - 1, 0)


def job_restarts(job_spec: dict, what: str = "") -> Restarts:
    """What the Job controller (kubernetes pkg/controller/job) does after a pod of `job_spec`
    fails: `Never` pods are replaced until more than backoffLimit pods failed, or per index
    with backoffLimitPerIndex (the Job fails once more than maxFailedIndexes indexes failed);
    `OnFailure` containers restart in place until their restart counts sum to backoffLimit.
    `what` names the Job in the message (`the runtime's Job`)."""
    policy = ((job_spec.get("template") or {}).get("spec") or {}).get("restartPolicy", "Never")
    limit = job_spec.get("backoffLimit")
    limit = 6 if limit is None else int(limit)  # the API server's default
    prefix = f"{what} " if what else ""
    per_index = job_spec.get("backoffLimitPerIndex")
    if per_index is not None and policy == "Never":
        return Restarts("pod", int(per_index), (1, 255),
                        f"{prefix}backoffLimitPerIndex {per_index}", per_pod=True)
    if policy == "OnFailure":
        return Restarts("pod", counted_restarts(limit), (1, 255),
                        f"{prefix}backoffLimit {limit}, restarts of all pods")
    return Restarts("pod", limit, (1, 255), f"{prefix}backoffLimit {limit}, failed pods")


def env(name: str, value: object) -> dict:
    return {"name": name, "value": str(value)}


def completion_index_env(name: str, source: str) -> dict:
    """`name` as a fieldRef to the completion index of an Indexed Job's pod, read from its
    `source` ("labels" or "annotations": both carry it). apiVersion v1 is the API server's
    default for a fieldRef, as the live pod shows it."""
    return {"name": name, "valueFrom": {"fieldRef": {
        "apiVersion": "v1", "fieldPath": f"metadata.{source}['{COMPLETION_INDEX_KEY}']"}}}


def append_env(container: dict, items: list[dict]) -> None:
    """Append (a later entry of the same name wins in the kubelet)."""
    container["env"] = [*(container.get("env") or []), *copy.deepcopy(items)]


def upsert_env(container: dict, items: list[dict]) -> None:
    """Replace an entry of the same name in place, else append (Trainer's apply.UpsertEnvVars)."""
    current = list(container.get("env") or [])
    for item in items:
        at = next((i for i, e in enumerate(current) if e.get("name") == item["name"]), None)
        if at is None:
            current.append(copy.deepcopy(item))
        else:
            current[at] = copy.deepcopy(item)
    container["env"] = current


def service_names(name: str, namespace: str) -> list[str]:
    """What cluster DNS serves for `name` (a Service, or `<hostname>.<subdomain>`), as a pod in
    `namespace` may write it: short, namespaced, `.svc` and fully qualified."""
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
            f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]


def template_labels(template: dict) -> dict:
    return dict((template.get("metadata") or {}).get("labels") or {})


def template_annotations(template: dict) -> dict:
    return dict((template.get("metadata") or {}).get("annotations") or {})


def _check_runnable(job_name: str, job_spec: dict) -> None:
    if job_spec.get("suspend"):
        raise UserError(f"Job {job_name}: suspended (spec.suspend); on a cluster no pod starts "
                        "until it is resumed (e.g. admitted by Kueue), and --docker cannot do that")


def _check_counts(job_name: str, job_spec: dict) -> None:
    count = int(job_spec.get("parallelism", 1))
    completions = int(job_spec.get("completions", count))
    if completions != count:
        raise UserError(f"Job {job_name}: parallelism {count} != completions {completions}: "
                        "some nodes would never start together with the others")


def indexed_job_pods(job_name: str, namespace: str, job_spec: dict, *, first_index: int,
                     labels: dict[str, str], annotations: dict[str, str],
                     subdomain: str | None) -> list[Pod]:
    """An Indexed Job's pods (kubernetes pkg/controller/job/job_controller.go and
    indexed_job_utils.go): pod `i` gets hostname `<job>-<i>`, the completion-index annotation and
    label, the `batch.kubernetes.io/job-name` label, and JOB_COMPLETION_INDEX appended to every
    container that does not set it (addCompletionIndexEnvVariable; it reads the label since the
    PodIndexLabel feature, GA in 1.32: seen on the testbed's 1.34)."""
    if job_spec.get("completionMode") != "Indexed":
        raise UserError(f"Job {job_name}: completionMode must be Indexed (pods need stable "
                        "hostnames and JOB_COMPLETION_INDEX)")
    _check_runnable(job_name, job_spec)
    _check_counts(job_name, job_spec)
    template = job_spec["template"]
    count = int(job_spec.get("parallelism", 1))
    # with backoffLimitPerIndex each pod carries its index's failures so far (none: first pods)
    per_index = {INDEX_FAILURES_KEY: "0"} if job_spec.get("backoffLimitPerIndex") is not None else {}
    pods = []
    for i in range(count):
        hostname = f"{job_name}-{i}"
        tpl = copy.deepcopy(template)
        for c in [*(tpl["spec"].get("initContainers") or []), *tpl["spec"].get("containers", [])]:
            if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in c.get("env") or []):
                append_env(c, [completion_index_env("JOB_COMPLETION_INDEX", "labels")])
        pod = Pod(name=hostname, index=first_index + i, namespace=namespace, hostname=hostname,
                  subdomain=subdomain or tpl["spec"].get("subdomain"), template=tpl,
                  labels={**template_labels(template), **labels,
                          "batch.kubernetes.io/job-name": job_name, "job-name": job_name,
                          COMPLETION_INDEX_KEY: str(i)},
                  annotations={**template_annotations(template), **annotations,
                               COMPLETION_INDEX_KEY: str(i), **per_index})
        tpl.setdefault("metadata", {})["labels"] = dict(pod.labels)
        tpl["metadata"]["annotations"] = dict(pod.annotations)
        pods.append(pod)
    return pods


#: k8s.io/apimachinery pkg/util/rand: the alphabet of generateName's suffix (no vowels, no
#: look-alikes); apiserver names.SimpleNameGenerator: base cut to 58 characters, 5 random ones.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def generated_name(base: str) -> str:
    return f"{base[:58]}{''.join(random.choice(_NAME_ALPHABET) for _ in range(5))}"


def job_pods(job_name: str, namespace: str, job_spec: dict, *, first_index: int,
             labels: dict[str, str], annotations: dict[str, str], subdomain: str | None) -> list[Pod]:
    """The pods of a Job of either completion mode (a JobSet's replicated job may be either)."""
    make = indexed_job_pods if job_spec.get("completionMode") == "Indexed" else nonindexed_job_pods
    return make(job_name, namespace, job_spec, first_index=first_index, labels=labels,
                annotations=annotations, subdomain=subdomain)


def nonindexed_job_pods(job_name: str, namespace: str, job_spec: dict, *, first_index: int,
                        labels: dict[str, str], annotations: dict[str, str],
                        subdomain: str | None) -> list[Pod]:
    """A NonIndexed Job's pods (kubernetes pkg/controller/job/job_controller.go manageJob: the
    pod template as is, generateName `<job>-`): no completion index (no label, annotation or
    JOB_COMPLETION_INDEX), no spec.hostname, so the hostname is the random pod name and cluster
    DNS serves no `<hostname>.<subdomain>` for it (the EndpointSlice controller publishes a
    hostname only for a pod with spec.hostname). Completions unset with parallelism above 1 is
    a work queue (the Job succeeds once any pod has, pkg/controller/job: succeeded > 0 and none
    active): --docker waits for every pod, so it refuses that."""
    _check_runnable(job_name, job_spec)
    count = int(job_spec.get("parallelism", 1))
    if job_spec.get("completions") is None and count > 1:
        raise UserError(f"Job {job_name}: NonIndexed with parallelism {count} and no completions is a "
                        "work queue (done when any pod succeeds); --docker runs jobs whose every pod "
                        "must succeed: set completions to the parallelism, or completionMode: Indexed")
    _check_counts(job_name, job_spec)
    template = job_spec["template"]
    pods = []
    for i in range(count):
        name = generated_name(f"{job_name}-")
        tpl = copy.deepcopy(template)
        pod = Pod(name=name, index=first_index + i, namespace=namespace, hostname=name[:63],
                  subdomain=subdomain or tpl["spec"].get("subdomain"), template=tpl,
                  labels={**template_labels(template), **labels,
                          "batch.kubernetes.io/job-name": job_name, "job-name": job_name},
                  annotations={**template_annotations(template), **annotations})
        tpl.setdefault("metadata", {})["labels"] = dict(pod.labels)
        tpl["metadata"]["annotations"] = dict(pod.annotations)
        pods.append(pod)
    return pods


def merge_pod_template(base: dict, patch: dict) -> None:
    """Strategic-merge-like: metadata maps merged, containers merged by name, lists of named
    things (volumes, initContainers) merged by name, other fields replaced."""
    for key in ("labels", "annotations"):
        if (patch.get("metadata") or {}).get(key):
            base.setdefault("metadata", {}).setdefault(key, {}).update(patch["metadata"][key])
    bspec, pspec = base.setdefault("spec", {}), patch.get("spec") or {}
    for key, value in pspec.items():
        if key in ("containers", "initContainers", "volumes"):
            items = bspec.setdefault(key, [])
            for new in value:
                old = next((i for i in items if i.get("name") == new.get("name")), None)
                if old is None:
                    items.append(copy.deepcopy(new))
                else:
                    old.update(copy.deepcopy(new))
        else:
            bspec[key] = copy.deepcopy(value)
