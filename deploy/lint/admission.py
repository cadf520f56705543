"""The operators' admission webhooks, per kind: `default` (mutating), `validate`, `warnings`.

Each module ports one upstream webhook line by line and cites it; `WEBHOOKS` maps
(API group, kind) to its `Webhook`. They judge any manifest, upstream ones included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from deploy.k8s.jobset import operator as jobset
from deploy.k8s.pytorchjob import operator as pytorchjob
from deploy.k8s.trainjob import operator as trainjob
from deploy.lint.report import Finding


def _none(obj: dict, *_: Any) -> list:
    return []


class Webhook(NamedTuple):
    default: Callable[[dict], Any]  # in place, as the mutating webhook's patch
    validate: Callable[..., list[Finding]]  # (obj, find_runtime) -> errors
    warnings: Callable[[dict], list[Finding]] = _none  # admission warnings (kubectl prints them)


WEBHOOKS = {
    (pytorchjob.GROUP, pytorchjob.KIND): Webhook(pytorchjob.default, pytorchjob.validate, pytorchjob.warnings),
    (jobset.GROUP, jobset.KIND): Webhook(jobset.default, jobset.validate),
    (trainjob.GROUP, trainjob.KIND): Webhook(trainjob.default, trainjob.validate),
    (trainjob.GROUP, "ClusterTrainingRuntime"): Webhook(_none, trainjob.validate_runtime),
    (trainjob.GROUP, "TrainingRuntime"): Webhook(_none, trainjob.validate_runtime),
}
