"""The operators' admission webhooks, per kind: `default` (mutating) then `validate`.

Each module ports one upstream webhook line by line and cites it; `WEBHOOKS` maps
(API group, kind) to (default, validate). They judge any manifest, upstream ones included.
"""

from __future__ import annotations

from deploy.lint.admission import jobset, pytorchjob, trainjob

WEBHOOKS = {
    (pytorchjob.GROUP, pytorchjob.KIND): (pytorchjob.default, pytorchjob.validate),
    (jobset.GROUP, jobset.KIND): (jobset.default, jobset.validate),
    (trainjob.GROUP, trainjob.KIND): (trainjob.default, trainjob.validate),
    (trainjob.GROUP, "ClusterTrainingRuntime"): (lambda obj: None, trainjob.validate_runtime),
    (trainjob.GROUP, "TrainingRuntime"): (lambda obj: None, trainjob.validate_runtime),
}
