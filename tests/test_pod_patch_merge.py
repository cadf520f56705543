"""`k8s.pod_patch` merges as Kubernetes' own strategic merge patch does: ddpkit's merge
(`deploy.k8s.pod.strategic_merge`) against `kubectl patch --local --type strategic` (the real
apimachinery code, compiled from upstream by the testbed's build) on generated pod specs and
patches. Needs the testbed's kubectl (k8s/testbed/build.sh); it runs with the testbed modules
(tests/conftest.py), after the cold build.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.k8s.pod import strategic_merge
from tests.conftest import IN_CI, require

try:
    from deploy.testbed import k8s as testbed
except ImportError:  # pragma: no cover
    testbed = None

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kubectl() -> str:
    require(testbed is not None, "the Kubernetes testbed (deploy.testbed.k8s) is not in this checkout")
    if IN_CI or os.geteuid() == 0:
        require(os.geteuid() == 0, "building the testbed's kubectl needs root")
        testbed.ensure_binaries()
    require(os.path.exists(testbed.kubectl()), f"no kubectl at {testbed.kubectl()}: run k8s/testbed/build.sh")
    return testbed.kubectl()


names = st.sampled_from(["a", "b", "c"])
values = st.text("xyz019", min_size=1, max_size=3)
env = st.lists(st.fixed_dictionaries({"name": names, "value": values}), max_size=3,
               unique_by=lambda e: e["name"])
mounts = st.lists(st.fixed_dictionaries({"name": names, "mountPath": st.sampled_from(["/m1", "/m2", "/m3"])}),
                  max_size=2, unique_by=lambda m: m["mountPath"])
container = st.fixed_dictionaries({"name": st.sampled_from(["trainer", "side"])},
                                  optional={"image": values, "env": env, "volumeMounts": mounts,
                                            "args": st.lists(values, max_size=2)})
volumes = st.lists(st.fixed_dictionaries({"name": names, "emptyDir": st.just({})}), max_size=2,
                   unique_by=lambda v: v["name"])
selector = st.dictionaries(st.sampled_from(["zone", "rack"]), values, max_size=2)
spec = st.fixed_dictionaries({"containers": st.lists(container, min_size=1, max_size=2, unique_by=lambda c: c["name"])},
                             optional={"volumes": volumes, "nodeSelector": selector,
                                       "terminationGracePeriodSeconds": st.integers(1, 99),
                                       "tolerations": st.lists(st.fixed_dictionaries(
                                           {"key": names, "operator": st.just("Exists")}), max_size=2)})
#: A patch may also delete a map key (null), as the job file's pod_patch can.
patch_spec = spec.flatmap(lambda s: st.fixed_dictionaries(
    {}, optional={"nodeSelector": st.dictionaries(st.sampled_from(["zone", "rack"]), st.none() | values,
                                                  max_size=2)}).map(lambda extra: {**s, **extra}))


def kubectl_merge(kubectl: str, base: dict, patch: dict, tmp_path) -> dict:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": base}
    path = tmp_path / "pod.json"
    path.write_text(json.dumps(pod))
    out = subprocess.run([kubectl, "patch", "--local", "--type", "strategic", "-f", str(path), "-o", "json",
                          "-p", json.dumps({"spec": patch})],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "KUBECONFIG": "/dev/null"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["spec"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(base=spec, patch=patch_spec)
def test_pod_patch_merges_like_kubectl_s_strategic_merge(kubectl, tmp_path, base, patch):
    assert strategic_merge({"spec": base}, {"spec": patch})["spec"] == kubectl_merge(kubectl, base, patch, tmp_path)
