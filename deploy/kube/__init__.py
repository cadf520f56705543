"""Kubernetes names and facts that the job model needs, below every flavor module.

Kubernetes' own name rules (with upstream's messages), the flavor names, ddpkit's state
vocabulary and the labels it puts on everything. `deploy.spec` validates names with these
rules and offers `FLAVORS`; the flavor modules, the renderer, the submitters and `ddpkit lint`
use the rest. Standard library only.

Beside it, the API server's own rules with its messages, which the job model, the flavors'
operators and `ddpkit lint` all use: `meta` (ObjectMeta), `core` (the core kinds: Job, Service,
pod specs), `finding` (what a rule finds: a field path and a message). This module imports none
of them.
"""

from __future__ import annotations

import re

# Kubernetes' name rules with upstream's messages: k8s.io/apimachinery v0.34
# pkg/util/validation/validation.go (IsDNS1123Label, IsDNS1123Subdomain, IsDNS1035Label,
# IsQualifiedName, IsValidLabelValue). The job model and `ddpkit lint` both use them.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(rf"^{_LABEL}$")
DNS1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IANA_SVC_NAME = re.compile(r"^[-a-z0-9]+$")

_MAX_LEN = "must be no more than {} characters"


def is_dns1123_label(value: str) -> list[str]:
    errs = [_MAX_LEN.format(63)] if len(value) > 63 else []
    if not DNS1123_LABEL.match(value):
        errs.append("a lowercase RFC 1123 label must consist of lower case alphanumeric characters "
                    "or '-', and must start and end with an alphanumeric character (e.g. 'my-name',"
                    "  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
    return errs


def is_dns1123_subdomain(value: str) -> list[str]:
    errs = [_MAX_LEN.format(253)] if len(value) > 253 else []
    if not DNS1123_SUBDOMAIN.match(value):
        errs.append("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                    "characters, '-' or '.', and must start and end with an alphanumeric character "
                    "(e.g. 'example.com', regex used for validation is "
                    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
    return errs


def is_dns1035_label(value: str) -> list[str]:
    errs = [_MAX_LEN.format(63)] if len(value) > 63 else []
    if not DNS1035_LABEL.match(value):
        errs.append("a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
                    "start with an alphabetic character, and end with an alphanumeric character "
                    "(e.g. 'my-name',  or 'abc-123', regex used for validation is "
                    "'[a-z]([-a-z0-9]*[a-z0-9])?')")
    return errs


def is_qualified_name(value: str) -> list[str]:
    """A label or annotation key: `[prefix/]name`."""
    prefix, slash, name = value.rpartition("/")
    errs = []
    if slash and not prefix:
        errs.append("prefix part must be non-empty")
    elif prefix:
        errs += [f"prefix part {e}" for e in is_dns1123_subdomain(prefix)]
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > 63:
        errs.append("name part " + _MAX_LEN.format(63))
    if name and not QUALIFIED_NAME.match(name):
        errs.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                    "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  "
                    "or '123-abc', regex used for validation is "
                    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
    return errs


def is_label_value(value: str) -> list[str]:
    errs = [_MAX_LEN.format(63)] if len(value) > 63 else []
    if not LABEL_VALUE.match(value):
        errs.append("a valid label must be an empty string or consist of alphanumeric characters, "
                    "'-', '_' or '.', and must start and end with an alphanumeric character (e.g. "
                    "'MyValue',  or 'my_value',  or '12345', regex used for validation is "
                    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
    return errs
#: The name part of a qualified name (a label key without its prefix).
LABEL_NAME = QUALIFIED_NAME

#: Each flavor (`k8s.flavor`, `--flavor`) and the kind of its workload object; the flavor
#: modules `deploy.k8s.<flavor>` own everything else about them.
FLAVOR_KIND = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob", "jobset": "JobSet", "job": "Job"}
FLAVORS = tuple(FLAVOR_KIND)

#: ddpkit's job states, the vocabulary shared by every target (Slurm too). QUEUED: held whole
#: by an admission queue (Kueue) before any pod exists, or again after the queue preempted it;
#: PENDING: admitted (or never queued), its pods not all running yet.
STATES = ("QUEUED", "PENDING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED")
#: The states a job does not leave.
TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})

#: Kubernetes' annotation (and, since 1.28, label) with an Indexed Job pod's index
#: (kubernetes pkg/apis/batch/types.go JobCompletionIndexAnnotation).
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Kueue's topology-aware scheduling requests on a pod template (kueue apis/kueue/v1beta2
#: topology_types.go).
KUEUE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
#: The label Kueue puts on a job's Workload: the job's UID (kueue pkg/controller/constants).
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
#: Kueue's Workload objects (the admission record of one job).
KUEUE_WORKLOAD_API_VERSION = "kueue.x-k8s.io/v1beta2"

#: Where every pod finds the job file (the ConfigMap `<name>-job`, key job.yaml).
JOB_FILE_DIR = "/etc/ddpkit"
JOB_FILE_NAME = "job.yaml"
JOB_FILE_PATH = f"{JOB_FILE_DIR}/{JOB_FILE_NAME}"
#: The pod volumes ddpkit adds before the job's own (deploy/k8s/pod.py), and what each holds.
POD_VOLUMES = {"ddpkit-job": "the job file's ConfigMap", "dshm": "the memory-backed /dev/shm"}
#: `workdir:` on Kubernetes: the pod's copy of the tree (an emptyDir, mounted at WORKDIR_MOUNT, the
#: containers' working directory) and the ConfigMap whose archive an init container unpacks into it.
WORKDIR_MOUNT = "/workdir"
WORKDIR_VOLUMES = {"ddpkit-workdir": "the job's workdir (an emptyDir)",
                   "ddpkit-workdir-archive": "the archive of the job's workdir (a ConfigMap)"}
#: Field manager of every server-side apply (`ddpkit submit k8s`).
FIELD_MANAGER = "ddpkit"


def workdir_configmap_name(job_name: str) -> str:
    """The ConfigMap carrying a job's workdir (deploy/k8s/pod.py `workdir_configmap`)."""
    return f"{job_name}-workdir"


def configmap_name(job_name: str) -> str:
    """The ConfigMap carrying a job's job file."""
    return f"{job_name}-job"


def pod_selector(job_name: str) -> dict[str, str]:
    """Labels that select a job's pods (the `job` flavor's Service, `ddpkit logs`); the job
    file may not override them (`k8s.labels`)."""
    return {"app.kubernetes.io/instance": job_name, "app.kubernetes.io/managed-by": "ddpkit"}


def pod_label_selector(job_name: str) -> str:
    """`pod_selector` as the API's label selector (`key=value,key=value`)."""
    return ",".join(f"{k}={v}" for k, v in pod_selector(job_name).items())


def common_labels(job_name: str) -> dict[str, str]:
    """`app.kubernetes.io/*` labels of every object and pod ddpkit renders."""
    return {"app.kubernetes.io/name": "ddpkit", "app.kubernetes.io/instance": job_name,
            "app.kubernetes.io/component": "trainer", "app.kubernetes.io/managed-by": "ddpkit"}


#: GPU vendors by the domain of their device plugin's resource names: the NVIDIA device plugin
#: advertises `nvidia.com/gpu`, MIG slices `nvidia.com/mig-3g.40gb` (mig-strategy mixed) and
#: shared GPUs `nvidia.com/gpu.shared` (time-slicing with renameByDefault); AMD's `amd.com/gpu`.
GPU_VENDORS = {"nvidia.com": "nvidia", "amd.com": "amd"}


def gpu_vendor(resource: str) -> str | None:
    """The vendor of an extended resource name (`nvidia`, `amd`), by its domain, or None."""
    return GPU_VENDORS.get(resource.partition("/")[0])
