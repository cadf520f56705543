"""JobSet admission, ported from JobSet v0.12.0 `pkg/webhooks/jobset_webhook.go`: the mutating
webhook's `Default` and the validating webhook's `ValidateCreate`, messages kept. Feature gates
at their defaults (InPlaceRestart, RestartJob: off). The VolumeClaimPolicies check against an
existing PVC of the same name needs the cluster: offline, no such PVC is assumed.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any

from deploy import kube
from deploy.errors import UserError
from deploy.k8s.controller import Pod, Restarts, job_pods, job_restarts, service_names
from deploy.kube import meta as m
from deploy.kube.finding import Finding

MAX_INT32 = 2**31 - 1
JOB_FAILURE_REASONS = ["BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
                       "MaxFailedIndexesExceeded", "PodFailurePolicy"]
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def default(obj: dict) -> None:
    """jobSetWebhook.Default, in place."""
    spec = obj.setdefault("spec", {})
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    for rjob in spec.get("replicatedJobs") or []:
        job_spec = rjob.setdefault("template", {}).setdefault("spec", {})
        job_spec.setdefault("completionMode", "Indexed")
        pod = job_spec.setdefault("template", {}).setdefault("spec", {})
        if not pod.get("restartPolicy"):
            pod["restartPolicy"] = "OnFailure"
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    for i, rule in enumerate((spec.get("failurePolicy") or {}).get("rules") or []):
        if not rule.get("name"):
            rule["name"] = f"failurePolicyRule{i}"
    for policy in spec.get("volumeClaimPolicies") or []:
        policy.setdefault("retentionPolicy", {"whenDeleted": "Delete"})


def _dns1035(path: str, value: str, too_long: str) -> list[Finding]:
    return [m.invalid(path, value, too_long if "must be no more than 63" in e else e)
            for e in kube.is_dns1035_label(value)]


def validate(obj: dict, context: Any = None) -> list[Finding]:
    """jobSetWebhook.ValidateCreate (errors without a field are reported at `spec`)."""
    name = (obj.get("metadata") or {}).get("name") or ""
    spec = obj.get("spec") or {}
    rjobs = spec.get("replicatedJobs") or []
    failure = spec.get("failurePolicy")
    found: list[Finding] = []
    if failure and failure.get("restartStrategy") == "InPlaceRestart":
        found.append(("spec", "InPlaceRestart restart strategy cannot be set when InPlaceRestart feature gate is disabled"))
    if rjobs and rjobs[0].get("dependsOn") is not None:
        found.append(("spec", "DependsOn can't be set for the first ReplicatedJob"))
    subdomain = (spec.get("network") or {}).get("subdomain")
    if subdomain:
        found += [m.invalid("spec.network.subdomain", subdomain, e) for e in kube.is_dns1123_subdomain(subdomain)]
        found += _dns1035("spec.network.subdomain", subdomain,
                          ".spec.network.subdomain is too long, must be less than 63 characters")
    manager = spec.get("managedBy")
    if manager is not None:
        found += m.is_domain_prefixed_path("spec.managedBy", manager)
        if len(manager) > 63:
            found.append(("spec.managedBy", "Too long: may not be more than 63 bytes"))
    names: set[str] = set()
    for i, rjob in enumerate(rjobs):
        path = f"spec.replicatedJobs[{i}]"
        rname = rjob.get("name") or ""
        names.add(rname)
        job_spec = (rjob.get("template") or {}).get("spec") or {}
        replicas = rjob.get("replicas", 1)
        parallelism = job_spec.get("parallelism", 1)
        if parallelism * replicas > MAX_INT32:
            found.append((path, f"the product of replicas and parallelism must not exceed {MAX_INT32} "
                                f"for replicatedJob '{rname}'"))
        found += _dns1035(f"{path}.groupName", rjob.get("groupName") or "",
                          ".spec.replicatedJob[].groupName is too long, must be less than 63 characters")
        longest_job = f"{name}-{rname}-{replicas - 1}"
        found += [(f"{path}.name", msg) for _, msg in _dns1035(
            f"{path}.name", longest_job, "JobSet name is too long, job names generated for this JobSet will exceed 63 characters")]
        if job_spec.get("completionMode") == "Indexed" and job_spec.get("completions") is not None:
            longest_pod = f"{name}-{rname}-{replicas - 1}-{job_spec['completions'] - 1}-abcde"
            found += [m.invalid(f"{path}.name", longest_job, msg.split(": ", 2)[-1]) for _, msg in _dns1035(
                f"{path}.name", longest_pod, "JobSet name is too long, pod names generated for this JobSet will exceed 63 characters")]
        for dep in rjob.get("dependsOn") or []:
            if dep.get("name") not in names:
                found.append((path, f"replicatedJob: {rname} cannot depend on replicatedJob: {dep.get('name')}"))
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or []:
        if target not in names:
            found.append(("spec.successPolicy", f"invalid replicatedJob name '{target}' does not appear in .spec.ReplicatedJobs"))
    if failure:
        found += _validate_failure_policy(failure)
        for rule in failure.get("rules") or []:
            for target in rule.get("targetReplicatedJobs") or []:
                if target not in names:
                    found.append(("spec.failurePolicy", f"invalid replicatedJob name '{target}' in failure "
                                                        "policy does not appear in .spec.ReplicatedJobs"))
    if spec.get("coordinator") is not None:
        found += _validate_coordinator(obj)
    found += _validate_volume_claim_policies(obj)
    return found


def _validate_failure_policy(failure: dict) -> list[Finding]:
    rules = failure.get("rules") or []
    if any(r.get("action") in ("RestartJob", "RestartJobAndIgnoreMaxRestarts") for r in rules):
        return [("spec.failurePolicy", "RestartJob and RestartJobAndIgnoreMaxRestarts failure policy actions "
                                       "are not allowed when RestartJob feature gate is disabled")]
    found: list[Finding] = []
    by_name: dict[str, list[int]] = {}
    for i, rule in enumerate(rules):
        rname = rule.get("name") or ""
        if not 1 <= len(rname) <= 128:
            found.append(("spec.failurePolicy", f"invalid failure policy rule name of length {len(rname)}, the "
                                                "rule name must be at least 1 characters long and at most 128 characters long"))
        by_name.setdefault(rname, []).append(i)
        if not _RULE_NAME.match(rname):
            found.append(("spec.failurePolicy", f"invalid failure policy rule name '{rname}', a failure policy "
                          "rule name must start with an alphabetic character, optionally followed by a string "
                          "of alphanumeric characters or '_,:', and must end with an alphanumeric character or '_'"))
        for reason in rule.get("onJobFailureReasons") or []:
            if reason not in JOB_FAILURE_REASONS:
                found.append(("spec.failurePolicy", f"invalid job failure reason '{reason}' in failure policy is "
                                                    "not a recognized job failure reason"))
    for rname, indices in by_name.items():
        if len(indices) > 1:
            found.append(("spec.failurePolicy", f"rule names are not unique, rules with indices "
                                                f"[{' '.join(map(str, indices))}] all have the same name '{rname}'"))
    return found


def _validate_coordinator(obj: dict) -> list[Finding]:
    spec = obj["spec"]
    coord = spec["coordinator"] or {}
    target = coord.get("replicatedJob")
    rjob = next((r for r in spec.get("replicatedJobs") or [] if r.get("name") == target), None)
    found: list[Finding] = []
    job_index, pod_index = coord.get("jobIndex", 0), coord.get("podIndex", 0)
    if rjob is None:
        found.append(("spec.coordinator", f"coordinator replicatedJob {target} does not exist"))
    elif not 0 <= job_index < rjob.get("replicas", 1):
        found.append(("spec.coordinator", f"coordinator job index {job_index} is invalid for replicatedJob {target}"))
    else:
        job_spec = (rjob.get("template") or {}).get("spec") or {}
        if job_spec.get("completionMode") != "Indexed" or job_spec.get("completions") is None:
            found.append(("spec.coordinator", "job for coordinator pod must be indexed completion mode, "
                                              "and completions number must be set"))
        elif not 0 <= pod_index < job_spec["completions"]:
            found.append(("spec.coordinator", f"coordinator pod index {pod_index} is invalid for replicatedJob "
                                              f"{target} job index {job_index}"))
    name = (obj.get("metadata") or {}).get("name") or ""
    subdomain = (spec.get("network") or {}).get("subdomain") or name
    endpoint = f"{name}-{target}-{job_index}-{pod_index}.{subdomain}"
    errs = kube.is_label_value(endpoint)
    if errs:
        found.append(("spec.coordinator", f"spec will lead to invalid label value {endpoint!r} for coordinator "
                      f"label \"jobset.sigs.k8s.io/coordinator\" (long JobSet / ReplicatedJob / SubDomain name?): "
                      f"{', '.join(errs)}"))
    return found


def _validate_volume_claim_policies(obj: dict) -> list[Finding]:
    spec = obj["spec"]
    name = (obj.get("metadata") or {}).get("name") or ""
    rjobs = spec.get("replicatedJobs") or []
    found: list[Finding] = []
    claims: set[str] = set()
    for i, policy in enumerate(spec.get("volumeClaimPolicies") or []):
        for j, template in enumerate(policy.get("templates") or []):
            path = f"spec.volumeClaimPolicies[{i}].template[{j}].name"
            tname = (template.get("metadata") or {}).get("name") or template.get("name") or ""
            if tname in claims:
                found.append(m.invalid(path, tname, "names must be unique for VolumeClaimPolicies template"))
            found += [m.invalid(path, tname, e) for e in kube.is_dns1123_subdomain(tname)]
            if len(f"{tname}-{name}") > 63:
                found.append(m.invalid(path, tname, "VolumeClaimPolicies template name is too long"))
            mounted = False
            for k, rjob in enumerate(rjobs):
                pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
                for v, vol in enumerate(pod.get("volumes") or []):
                    if vol.get("name") == tname:
                        found.append(m.invalid(f"spec.replicatedJobs[{k}].template.spec.template.spec.volumes[{v}].name",
                                               tname, f"volume name conflicts with VolumeClaimPolicy template name: {tname}"))
                for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
                    mounted |= any(vm.get("name") == tname for vm in c.get("volumeMounts") or [])
            if not mounted:
                found.append(("spec.replicatedJobs", f"replicatedJob containers don't have a matching volumeMount: "
                                                     f"{tname} from VolumeClaimPolicies"))
            claims.add(tname)
    return found


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
#: api/jobset/v1alpha2/jobset_types.go: CoordinatorKey, ExclusiveKey, NodeSelectorStrategyKey.
COORDINATOR_KEY = "jobset.sigs.k8s.io/coordinator"
EXCLUSIVE_KEY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODE_SELECTOR_STRATEGY_KEY = "alpha.jobset.sigs.k8s.io/node-selector"



def defaulted(obj: dict) -> dict:
    """A copy of `obj` after the webhook's defaults: what the JobSet controller works on."""
    obj = copy.deepcopy(obj)
    default(obj)
    return obj


def pods(obj: dict, objects: list[dict], *, override=None) -> list[Pod]:
    """jobset pkg/controllers/jobset_controller.go constructJob: replicated job `r` copy `j` is
    an Indexed Job `<jobset>-<r>-<j>` whose Job and pod template get labelAndAnnotateObject's
    labels and annotations (and the pod webhook's priority label); with network.enableDNSHostnames every pod's subdomain is
    network.subdomain or the JobSet name, a headless Service the controller creates."""
    obj = defaulted(obj)
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
            coordinator = {COORDINATOR_KEY: coordinator_endpoint(obj)} if spec.get("coordinator") else {}
            _add_claim_volumes(job_spec, spec, name)
            made = job_pods(job_name, namespace, job_spec, first_index=len(found),
                            labels={**keys, **coordinator},
                            annotations={**keys, **coordinator, **_exclusive(obj, rjob)},
                            subdomain=subdomain)
            for p in made:
                p.group, p.depends_on = rjob["name"], _depends_on(rjob, found + made)
            if not job_spec["template"]["spec"].get("priorityClassName"):
                for p in made:  # the Priority admission plugin's 0 (a class's value is the cluster's)
                    p.labels[PRIORITY_KEY] = p.template["metadata"]["labels"][PRIORITY_KEY] = "0"
            if subdomain:
                for p in made:
                    p.template["spec"]["subdomain"] = subdomain
                    if job_spec.get("completionMode") == "Indexed":  # NonIndexed: no spec.hostname
                        p.dns_names = service_names(f"{p.hostname}.{subdomain}", namespace)
            found += made
            global_index += 1
    return found



def _depends_on(rjob: dict, pods: list[Pod]) -> list[tuple[str, str]]:
    """dependsOn (depends_on.go dependencyReachedStatus): the controller creates this replicated
    job's Jobs only once every Job of each named one is Complete (succeeded), or Ready (all its
    pods ready or succeeded; a failed Job counts too, and then fails the JobSet). --docker
    tells a pod Ready when its container started, which is the kubelet's Ready for a container
    without readiness or startup probe; with one it cannot judge readiness, so it refuses."""
    wanted = [(d.get("name"), d.get("status")) for d in rjob.get("dependsOn") or []]
    for target, status in wanted:
        for p in pods:
            probes = [k for c in p.spec.get("containers") or [] for k in ("readinessProbe", "startupProbe") if c.get(k)]
            if status == "Ready" and p.group == target and probes:
                raise UserError(f"JobSet replicatedJob {rjob.get('name')}: dependsOn {target} Ready, whose "
                                f"pods have a {probes[0]}: --docker cannot evaluate probes; use status: "
                                "Complete or drop the probe to run it here")
    return wanted


def coordinator_endpoint(obj: dict) -> str:
    """CoordinatorEndpoint (jobset_controller.go): `<jobset>-<rjob>-<jobIndex>-<podIndex>.<subdomain>`."""
    spec, name = obj["spec"], obj["metadata"]["name"]
    coord = spec["coordinator"]
    subdomain = (spec.get("network") or {}).get("subdomain") or name
    return f"{name}-{coord['replicatedJob']}-{coord.get('jobIndex', 0)}-{coord.get('podIndex', 0)}.{subdomain}"


def _exclusive(obj: dict, rjob: dict) -> dict[str, str]:
    """labelAndAnnotateObject: the exclusive-topology annotation (and node-selector strategy
    flag) of the JobSet, overridden by the replicated job's Job template's, on Job and pods."""
    found: dict[str, str] = {}
    for notes in ((obj.get("metadata") or {}).get("annotations") or {},
                  ((rjob.get("template") or {}).get("metadata") or {}).get("annotations") or {}):
        if EXCLUSIVE_KEY in notes:
            found[EXCLUSIVE_KEY] = notes[EXCLUSIVE_KEY]
            if NODE_SELECTOR_STRATEGY_KEY in notes:
                found[NODE_SELECTOR_STRATEGY_KEY] = notes[NODE_SELECTOR_STRATEGY_KEY]
    return found


def _add_claim_volumes(job_spec: dict, spec: dict, name: str) -> None:
    """addVolumes (volume_claim_policy.go): a volumeClaimPolicies template that a container or
    init container mounts becomes a volume of claim `<template>-<jobset>`."""
    pod = job_spec["template"].setdefault("spec", {})
    mounted = {m.get("name") for c in [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]
               for m in c.get("volumeMounts") or []}
    for policy in spec.get("volumeClaimPolicies") or []:
        for template in policy.get("templates") or []:
            vname = (template.get("metadata") or {}).get("name")
            if vname in mounted:
                pod.setdefault("volumes", []).append(
                    {"name": vname, "persistentVolumeClaim": {"claimName": f"{vname}-{name}"}})


def _suspended(name: str) -> Exception:
    return UserError(f"JobSet {name}: suspended (spec.suspend); on a cluster no pod starts until "
                     "it is resumed (e.g. admitted by Kueue), and --docker cannot do that")



def restarts(obj: dict, objects: list[dict]) -> Restarts:
    """After the webhook's defaults: while a replicated job's Job has backoffLimit left
    (Kubernetes' default 6) its failed pod is restarted alone (restartPolicy OnFailure, the
    JobSet default) or replaced (Never), as controller.job_restarts says; when the Job fails,
    failurePolicy.maxRestarts (default 0) recreates every Job of the set. ddpkit renders
    backoffLimit 0, so only the second applies. (--docker emulates the first level that
    applies, not both.)"""
    spec = defaulted(obj)["spec"]
    rjobs = spec.get("replicatedJobs") or [{}]
    job_spec = (rjobs[0].get("template") or {}).get("spec") or {}
    if job_spec.get("backoffLimit") is None or int(job_spec["backoffLimit"]) > 0:
        return job_restarts(job_spec, "the Job's")
    limit = int((spec.get("failurePolicy") or {}).get("maxRestarts", 0))
    return Restarts("gang", limit, (1, 255), f"failurePolicy.maxRestarts {limit}")
