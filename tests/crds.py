"""Where tests find the upstream CRDs: `<repo>/../shared/crds` (see its README).

Missing folder: the test skips with the reason, except under `CI=true`, where it fails.
"""

from pathlib import Path

from tests.conftest import SHARED, require

CRD_DIR = SHARED / "crds"


def crd_dir() -> Path:
    require(CRD_DIR.is_dir(), f"upstream CRDs not found at {CRD_DIR} (a folder of CRD YAML "
                              "beside the checkout, see shared/crds/README.md)")
    return CRD_DIR
