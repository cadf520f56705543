"""Kubernetes names and facts that the job model needs, below every flavor module.

`deploy.spec` validates names with these patterns and offers `FLAVORS`; the flavor modules,
the renderer, the submitters and `ddpkit lint` use the rest. Standard library only.
"""

from __future__ import annotations

import re

# Kubernetes' name rules (apimachinery pkg/util/validation)
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

#: Each flavor (`k8s.flavor`, `--flavor`) and the kind of its workload object; the flavor
#: modules `deploy.k8s.<flavor>` own everything else about them.
FLAVOR_KIND = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob", "jobset": "JobSet", "job": "Job"}
FLAVORS = tuple(FLAVOR_KIND)

#: ddpkit's job states, the vocabulary shared by every target (Slurm too).
STATES = ("PENDING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED")

#: Kubernetes' annotation (and, since 1.28, label) with an Indexed Job pod's index
#: (kubernetes pkg/apis/batch/types.go JobCompletionIndexAnnotation).
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

#: Where every pod finds the job file (the ConfigMap `<name>-job`, key job.yaml).
JOB_FILE_DIR = "/etc/ddpkit"
JOB_FILE_NAME = "job.yaml"
JOB_FILE_PATH = f"{JOB_FILE_DIR}/{JOB_FILE_NAME}"
#: Field manager of every server-side apply (`ddpkit submit k8s`).
FIELD_MANAGER = "ddpkit"


def configmap_name(job_name: str) -> str:
    """The ConfigMap carrying a job's job file."""
    return f"{job_name}-job"


def pod_selector(job_name: str) -> dict[str, str]:
    """Labels that select a job's pods (the `job` flavor's Service, `ddpkit logs`); the job
    file may not override them (`k8s.labels`)."""
    return {"app.kubernetes.io/instance": job_name, "app.kubernetes.io/managed-by": "ddpkit"}


def common_labels(job_name: str) -> dict[str, str]:
    """`app.kubernetes.io/*` labels of every object and pod ddpkit renders."""
    return {"app.kubernetes.io/name": "ddpkit", "app.kubernetes.io/instance": job_name,
            "app.kubernetes.io/component": "trainer", "app.kubernetes.io/managed-by": "ddpkit"}
