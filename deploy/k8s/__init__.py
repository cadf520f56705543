"""Kubernetes flavors: one module each (`pytorchjob`, `trainjob`, `jobset`, `job`).

A flavor module owns everything about its workload: the objects it builds (plain dicts,
serialized once by `deploy.k8s.render`), its names and DNS endpoint, its API coordinates, what
it cannot express (`check`), how its status conditions map to ddpkit's states (`state`), how a
pod's node rank is read (`node_rank`), and what its controller makes of the object: the pods
and the injected env (`pods`) and the restart behaviour (`restarts`), which `ddpkit run
--docker` runs. Every module has the same names:

    NAME, KIND, API_VERSION, PLURAL, CONTAINER, INSTALLS
    check(job) -> [(field path, message)]        objects(job) -> [dict]
    master_endpoint(job) -> (host, port)         state(obj) -> one of names.STATES
    node_rank(pod, pods) -> int | None            pods(obj, objects) -> [controller.Pod]
    restarts(obj, objects) -> controller.Restarts

Layers (no import cycles): `names` (standard library only; the job model `deploy.spec` uses
it) < `spec` < `pod` (the pod template and the checks every flavor shares) and `controller`
(what controllers make of pods, for `--docker`) < the flavor modules < `deploy.k8s.render`,
`deploy.submit.{k8s,docker}`, `deploy.lint`. A flavor module imports no third-party package, so
`status`, `logs`, `cancel` and `lint` load it cheaply.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deploy.kube import FLAVOR_KIND, FLAVORS

__all__ = ["FLAVORS", "flavor", "flavor_of_kind"]


def flavor(name: str) -> ModuleType:
    """The module of flavor `name` (imported on first use)."""
    if name not in FLAVORS:
        raise KeyError(name)
    return importlib.import_module(f"deploy.k8s.{name}")


def flavor_of_kind(kind: str) -> ModuleType | None:
    """The flavor whose workload object is `kind`, or None."""
    for name, k in FLAVOR_KIND.items():
        if k == kind:
            return flavor(name)
    return None
