"""Kubernetes flavors: one folder each (`pytorchjob`, `trainjob`, `jobset`, `job`).

A flavor folder owns everything about its workload, in two modules:

- `<flavor>/__init__.py`, what ddpkit renders: the facts (API coordinates, the container, the
  port, the labels its controller sets), `check(job)` (what it cannot express), `objects(job)`
  (plain dicts, serialized once by `deploy.k8s.render`), `master_endpoint(job)`,
  `state(obj)` (its conditions in ddpkit's states) and `node_rank(pod, pods)`;
- `<flavor>/operator.py`, what the upstream operator does with the object: its admission
  webhook ported line by line (`default`, `validate`, `warnings`; `ddpkit lint` runs them) and
  its controller's effects (`pods(obj, objects)`: the pods and the injected env, and
  `restarts(obj, objects)`), which `ddpkit run --docker` runs.

Layers (no import cycles): `deploy.kube` (Kubernetes' own rules: names, ObjectMeta, the core
kinds; the job model uses them) < `spec` < `pod` (the pod template and the checks every flavor
shares) and `controller` (what controllers make of pods) < `<flavor>/__init__` <
`<flavor>/operator` (which uses `deploy.kube.meta`) < `cluster` (the API seam) < `blame` <
`deploy.k8s.render`, `deploy.k8s.submit` < `deploy.run.docker`, `deploy.lint`. A flavor imports no third-party
package, so `status`, `logs`, `cancel` and `lint` load it cheaply.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deploy.kube import FLAVOR_KIND, FLAVORS

__all__ = ["FLAVORS", "flavor", "flavor_of_kind", "operator", "operator_of_kind"]


def flavor(name: str) -> ModuleType:
    """The module of flavor `name`, what ddpkit renders (imported on first use)."""
    return _part(name, "")


def operator(name: str) -> ModuleType:
    """What flavor `name`'s controller and webhooks do with its object (`<flavor>/operator.py`)."""
    return _part(name, ".operator")


def flavor_of_kind(kind: str) -> ModuleType | None:
    """The flavor whose workload object is `kind`, or None."""
    return next((flavor(n) for n, k in FLAVOR_KIND.items() if k == kind), None)


def operator_of_kind(kind: str) -> ModuleType | None:
    """The operator module of the flavor whose workload object is `kind`, or None."""
    return next((operator(n) for n, k in FLAVOR_KIND.items() if k == kind), None)


def _part(name: str, suffix: str) -> ModuleType:
    if name not in FLAVORS:
        raise KeyError(name)
    return importlib.import_module(f"deploy.k8s.{name}{suffix}")
