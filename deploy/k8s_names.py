"""Names and numbers of Kubernetes objects that more than one module needs.

Read by the job model (`deploy.spec`), the renderer (`deploy.render.k8s`), its Docker
emulation (`deploy.submit.docker`), `ddpkit lint` and the submit verbs (`deploy.submit.k8s`).
It imports only the standard library, so `lint`, `cancel` and `logs` use it without loading the
renderer (pydantic, jinja2).
"""

from __future__ import annotations

import re

# Kubernetes' name rules (apimachinery pkg/util/validation)
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# Upstream controllers' facts

#: Kubeflow training operator v1 (pkg/apis/kubeflow.org/v1/pytorch_types.go): the container it
#: configures, the name of its port and the port its defaulter adds when none is declared.
PYTORCHJOB_CONTAINER = "pytorch"
PYTORCHJOB_PORT_NAME = "pytorchjob-port"
PYTORCHJOB_PORT = 23456
#: Pod labels the training operator sets: replica type (lower case) and index within it.
PYTORCHJOB_REPLICA_TYPE = "training.kubeflow.org/replica-type"
PYTORCHJOB_REPLICA_INDEX = "training.kubeflow.org/replica-index"
#: Kubeflow Trainer v2 (pkg/constants/constants.go, ClusterTrainingRuntime `torch-distributed`):
#: the replicated job and container `node`, and ContainerTrainerPort (PET_MASTER_PORT).
TRAINJOB_NODE = "node"
TRAINJOB_PORT = 29500
#: Kubernetes' annotation (and, since 1.28, label) with an Indexed Job pod's index.
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"

# ddpkit's own names in what it renders

#: Each flavor (`k8s.flavor`, `--flavor`) and the kind of its workload object.
FLAVOR_KIND = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob", "jobset": "JobSet", "job": "Job"}
#: The training container of each flavor (the operators' names where they impose one).
CONTAINER_NAME = {"pytorchjob": PYTORCHJOB_CONTAINER, "trainjob": TRAINJOB_NODE,
                  "jobset": "trainer", "job": "trainer"}


def configmap_name(job_name: str) -> str:
    """The ConfigMap carrying a job's job file."""
    return f"{job_name}-job"


def pod_selector(job_name: str) -> dict[str, str]:
    """Labels that select a job's pods (the `job` flavor's Service, `ddpkit logs`)."""
    return {"app.kubernetes.io/instance": job_name, "app.kubernetes.io/managed-by": "ddpkit"}
