"""Where tests find the upstream CRDs: the unchanged copies `ddpkit lint` bundles
(deploy/lint/crds/, each file's upstream module, version and path in its README), so a clone
needs nothing beside it."""

from pathlib import Path

from deploy.lint.schema import BUNDLED_CRDS


def crd_dir() -> Path:
    return BUNDLED_CRDS
