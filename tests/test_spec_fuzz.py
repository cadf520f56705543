"""Property: whatever a job file holds, validation ends in a JobSpec or a UserError, never a crash."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.errors import UserError
from deploy.load import parse_job
from deploy.spec import JobSpec

KEYS = ["name", "image", "nodes", "gpus_per_node", "procs_per_node", "resources", "env",
        "secret_env", "volumes", "command", "restarts", "time_limit", "checkpoint", "train",
        "k8s", "slurm", "memory", "shm", "flavor", "namespace", "claim", "mount", "host_path",
        "launcher", "requeue", "signal", "extra_directives", "tolerations", "labels", "RANK", "x"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["2:4", "1Gi", "24h", "job", "/data", "--x=1"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)), max_leaves=20)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=8))
def test_any_mapping_validates_or_fails_cleanly(data):
    try:
        assert isinstance(parse_job({"name": "fuzz", "image": "i:1", **data}), JobSpec)
    except UserError as exc:
        assert exc.problems and all(p and "\n" not in p for p in exc.problems)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=3))
def test_any_override_validates_or_fails_cleanly(overrides):
    try:
        parse_job({"name": "fuzz", "image": "i:1", "volumes": []}, overrides=overrides)
    except UserError as exc:
        assert exc.problems
