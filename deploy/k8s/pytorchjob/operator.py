"""PyTorchJob admission, ported from training-operator v1.9.3 `pkg/webhooks/pytorch/pytorchjob_webhook.go`
and `pkg/common/util/webhooks.go` (ValidateRunPolicy). The operator has no mutating webhook
(its defaults are applied by the controller, after admission), so the validator sees the object
as written plus the CRD's defaults: a Master without `replicas` is refused ("must be 1").
"""

from __future__ import annotations

from typing import Any

from deploy.lint import meta as m
from deploy.lint.report import Finding

GROUP, KIND = "kubeflow.org", "PyTorchJob"
REPLICA_TYPES = ["Master", "Worker"]
CONTAINER = "pytorch"  # trainingoperator.PyTorchJobDefaultContainerName
MANAGERS = ["kueue.x-k8s.io/multikueue", "kubeflow.org/training-operator"]
SPECS = "spec.pytorchReplicaSpecs"


def default(obj: dict) -> None:
    """No mutating webhook for PyTorchJob in v1.9."""


def validate(obj: dict, context: Any = None) -> list[Finding]:
    found: list[Finding] = []
    name = (obj.get("metadata") or {}).get("name") or ""
    errs = m.is_dns1035_label(name)
    if errs:
        found.append(m.invalid("metadata.name", name, f"should match: {','.join(errs)}"))
    spec = obj.get("spec") or {}
    manager = (spec.get("runPolicy") or {}).get("managedBy")
    if manager is not None and manager not in MANAGERS:
        found.append(m.not_supported("spec.runPolicy.managedBy", manager, MANAGERS))
    elastic = spec.get("elasticPolicy")
    specs = spec.get("pytorchReplicaSpecs")
    if elastic is not None:
        if "Worker" not in (specs or {}):
            found.append(m.required(f"{SPECS}[Worker]", "must be configured if elastic policy is used"))
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            found.append(m.forbidden("spec.elasticPolicy.nProcPerNode", "must not be used with spec.nprocPerNode"))
    if specs is None:
        found.append(m.required(SPECS, "must be required"))
    for role, rspec in (specs or {}).items():
        path = f"{SPECS}[{role}]"
        containers_path = f"{path}.template.spec.containers"
        if role not in REPLICA_TYPES:
            found.append(m.not_supported(path, role, REPLICA_TYPES))
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            found.append(m.required(containers_path, "must be specified"))
        for i, container in enumerate(containers):
            if not container.get("image"):
                found.append(m.required(f"{containers_path}[{i}].image", "must be required"))
        if not any(c.get("name") == CONTAINER for c in containers):
            found.append(m.required(containers_path, f"must have at least one container with name {CONTAINER}"))
        replicas = (rspec or {}).get("replicas")
        if role == "Master" and replicas != 1:
            found.append(m.forbidden(f"{path}.replicas", "must be 1"))
        elif role != "Master" and replicas is not None and replicas < 1:
            found.append(m.forbidden(f"{path}.replicas", "must be at least 1"))
    return found


def warnings(obj: dict) -> list[Finding]:
    """The webhook's own admission warnings (returned with a 200; kubectl prints them)."""
    elastic = (obj.get("spec") or {}).get("elasticPolicy") or {}
    if elastic.get("nProcPerNode") is not None:
        return [("spec.elasticPolicy.nProcPerNode",
                 "spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead")]
    return []
