"""Test jobs, stated by what a test is about (like JobSet's `pkg/util/testing/wrappers.go`).

`make_job(nodes=2, k8s={"namespace": "ml"})` is the base job with those fields merged in
(mappings merge key by key, anything else replaces), validated by the real loader. The base
keeps its checkpoints in the container (`checkpoint.ephemeral`): the durability rules have
their own tests, and most tests are about something else.
"""

from __future__ import annotations

import copy
from typing import Any

from deploy.load import parse_job
from deploy.spec import JobSpec

BASE: dict[str, Any] = {"name": "demo", "image": "img:1", "checkpoint": {"ephemeral": True}}


def merged(base: dict, patch: dict) -> dict:
    """`patch` over `base`: nested mappings merge, other values replace."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def job_data(**fields: Any) -> dict:
    """The base job file as a mapping, with `fields` merged in."""
    return merged(BASE, fields)


def make_job(**fields: Any) -> JobSpec:
    """The base job with `fields` merged in, validated (UserError when it is not valid)."""
    return parse_job(job_data(**fields))


def workload(objects: list[dict]) -> dict:
    """The one workload object among rendered objects (not the ConfigMap or the Service)."""
    (found,) = [o for o in objects if o["kind"] not in ("ConfigMap", "Service")]
    return found
