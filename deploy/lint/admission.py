"""The operators' admission webhooks, per kind: `default` (mutating), `validate`, `warnings`.

Each flavor's `operator.py` ports its upstream webhook line by line and cites it; `WEBHOOKS`
maps (API group, kind) to its `Webhook`. They judge any manifest, upstream ones included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from deploy.k8s import jobset, pytorchjob, trainjob
from deploy.k8s.jobset import operator as jobset_webhook
from deploy.k8s.pytorchjob import operator as pytorchjob_webhook
from deploy.k8s.trainjob import operator as trainjob_webhook
from deploy.kube.finding import Finding


def _none(obj: dict, *_: Any) -> list:
    return []


class Webhook(NamedTuple):
    default: Callable[[dict], Any]  # in place, as the mutating webhook's patch
    validate: Callable[..., list[Finding]]  # (obj, find_runtime) -> errors
    warnings: Callable[[dict], list[Finding]] = _none  # admission warnings (kubectl prints them)


WEBHOOKS = {
    (pytorchjob.GROUP, pytorchjob.KIND): Webhook(pytorchjob_webhook.default, pytorchjob_webhook.validate,
                                                 pytorchjob_webhook.warnings),
    (jobset.GROUP, jobset.KIND): Webhook(jobset_webhook.default, jobset_webhook.validate),
    (trainjob.GROUP, trainjob.KIND): Webhook(trainjob_webhook.default, trainjob_webhook.validate),
    **{(trainjob.GROUP, kind): Webhook(_none, trainjob_webhook.validate_runtime)
       for kind in trainjob_webhook.RUNTIME_KINDS},
}
