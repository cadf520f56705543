"""Where tests find the upstream CRDs: `<repo>/../shared/crds` (see its README).

Missing folder: the test skips with the reason, except under `CI=true`, where it fails.
"""

import os
from pathlib import Path

import pytest

CRD_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "crds"


def crd_dir() -> Path:
    if CRD_DIR.is_dir():
        return CRD_DIR
    reason = (f"upstream CRDs not found at {CRD_DIR} (a folder of CRD YAML beside the checkout, "
              "see shared/crds/README.md)")
    if os.environ.get("CI") == "true":
        pytest.fail(reason + "; CI=true requires them")
    pytest.skip(reason)
