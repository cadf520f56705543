"""`workdir:` for real (issue 40): a script that is in no image runs from the shipped tree under
`run --docker` and on the Kubernetes testbed, on every flavor, with no registry; a bad tree is
refused before anything reaches the cluster. (Slurm's test is in tests/test_slurm_e2e.py.)

The image is ddpkit's test image, built offline from this working tree (tests/conftest.py
`docker_test_image`; on Kubernetes the `image` fixture also loads it into the nodes): the
script is not in it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from deploy import workdir
from deploy.load import load_job
from tests.conftest import (
    K8S_TEST_BASE_IMAGE,
    K8S_TEST_IMAGE,
    ddpkit,
    docker_test_image,
    forget_image,
    k8s_report,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IMAGE = K8S_TEST_IMAGE
FLAVORS = ["pytorchjob", "trainjob", "jobset", "job"]
SCRIPT = """import os, time
VERSION = "{version}"
print(f"workdir-e2e node {{os.environ.get('GROUP_RANK')}} version {{VERSION}} in {{os.getcwd()}}", flush=True)
time.sleep(5)  # node 0 hosts torchrun's store: stay until node 1's agent is done with it
"""


def tree_job(tmp_path: Path, name: str, flavor: str, **fields) -> tuple[Path, workdir.Snapshot]:
    """A tree with a train.py that is in no image, and its job file (2 nodes, the tree shipped)."""
    tree = tmp_path / name
    (tree / "pkg").mkdir(parents=True)
    (tree / "train.py").write_text(SCRIPT.format(version="v1"))
    (tree / "pkg" / "data.txt").write_text("shipped\n")
    job = {"name": name, "image": IMAGE, "nodes": 2, "script": "train.py", "workdir": ".",
           "resources": {"cpus_per_node": 0.7, "memory": "1Gi", "shm": "64Mi"}, "k8s": {"flavor": flavor},
           **fields}
    (tree / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return tree / "job.yaml", workdir.snapshot(load_job(str(tree / "job.yaml")))


def ran(text: str) -> set[tuple[str, str, str]]:
    return set(re.findall(r"workdir-e2e node (\d) version (\S+) in (\S+)", text))


# -- run --docker -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def docker_image() -> str:
    return docker_test_image(IMAGE, K8S_TEST_BASE_IMAGE)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_run_docker_runs_a_script_that_is_in_no_image_from_the_workdir(docker_image, tmp_path, flavor):
    path, snap = tree_job(tmp_path, f"wd-docker-{flavor}", flavor)
    result = ddpkit("run", str(path), "--docker", "--flavor", flavor, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ran(result.stdout) == {("0", "v1", "/workdir"), ("1", "v1", "/workdir")}, result.stdout[-3000:]
    assert f"workdir sha256:{snap.digest}" in result.stdout + result.stderr  # the launcher says what it runs


# -- Kubernetes ---------------------------------------------------------------------------------


def k8s_wait(cluster, handle: str, timeout: float = 600) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while k8s_report(cluster, handle).state not in ("SUCCEEDED", "FAILED", "CANCELLED") \
            and time.monotonic() < deadline:
        time.sleep(1)
    proc = ddpkit("status", handle, "--json", env=cluster)  # what the user sees, once it ended
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_kubernetes_runs_a_script_that_is_in_no_image_from_the_workdir(cluster, image, handles, tmp_path, flavor):
    path, snap = tree_job(tmp_path, f"wd-k8s-{flavor}", flavor)
    proc = ddpkit("submit", "k8s", str(path), env=cluster)
    assert proc.returncode == 0, proc.stderr
    assert f"shipped: workdir {path.parent} ({snap.describe()})" in proc.stderr
    handle = proc.stdout.strip()
    handles.append(handle)
    status = k8s_wait(cluster, handle)
    logs = "".join(ddpkit("logs", handle, "--rank", str(r), env=cluster).stdout for r in (0, 1))
    assert status["state"] == "SUCCEEDED", (status, logs[-3000:])
    assert ran(logs) == {("0", "v1", "/workdir"), ("1", "v1", "/workdir")}, logs[-3000:]
    assert status["workdir"] == {"sha256": snap.digest, "commit": None, "dirty": None}
    why = ddpkit("why", handle, env=cluster)
    assert why.stdout.splitlines()[-1] == f"  workdir sha256:{snap.digest}", why.stdout


@pytest.mark.parametrize("case", ["missing", "over the limit", "symlink out of the tree", "script outside"])
def test_kubernetes_refuses_a_bad_tree_and_sends_nothing(cluster, tmp_path, case):
    import os

    from deploy.testbed import k8s as testbed

    name = "wd-bad"
    path, _ = tree_job(tmp_path, name, "job")
    data = yaml.safe_load(path.read_text())
    if case == "missing":
        data["workdir"] = "nope"
    elif case == "over the limit":
        data["workdir"] = {"dir": ".", "max_size": "100"}
    elif case == "symlink out of the tree":
        (tmp_path / "secret").write_text("s")
        os.symlink(tmp_path / "secret", path.parent / "secret")
    else:
        data["script"] = "../train.py"
    path.write_text(yaml.safe_dump(data))
    proc = ddpkit("submit", "k8s", str(path), env=cluster)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    import subprocess

    for kind, obj in (("configmap", f"{name}-workdir"), ("configmap", f"{name}-job"), ("job", name)):
        got = subprocess.run([testbed.kubectl(), "get", kind, obj], env=cluster, capture_output=True, text=True)
        assert got.returncode != 0 and "NotFound" in got.stderr, (kind, obj, got.stdout)


# -- a tree over a ConfigMap's limit, as a thin image layer (`workdir.image`) -------------------


def big_tree_job(tmp_path: Path, name: str, flavor: str) -> tuple[Path, workdir.Snapshot]:
    """tree_job's tree plus 2 MiB that do not compress (over the 1 MiB a ConfigMap carries),
    shipped as an image layer under a repository no registry serves."""
    import os

    path, _ = tree_job(tmp_path, name, flavor)
    (path.parent / "pkg" / "weights.bin").write_bytes(os.urandom(2 << 20))
    job = yaml.safe_load(path.read_text())
    job["workdir"] = {"dir": ".", "image": f"ddpkit-workdir/{name}"}
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path, workdir.snapshot(load_job(str(path)))


def test_run_docker_runs_a_large_tree_from_its_image_layer(docker_image, tmp_path):
    path, snap = big_tree_job(tmp_path, "wd-docker-image", "trainjob")
    tag = snap.image("ddpkit-workdir/wd-docker-image", IMAGE)
    result = ddpkit("run", str(path), "--docker", cwd=tmp_path, timeout=600)
    forget_image(tag)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"ddpkit: workdir image {tag}: built in " in result.stderr, result.stderr[-3000:]
    assert ran(result.stdout) == {("0", "v1", "/workdir"), ("1", "v1", "/workdir")}, result.stdout[-3000:]


@pytest.mark.parametrize("flavor", ["trainjob", "job"])
def test_kubernetes_runs_a_large_tree_from_its_image_layer_with_no_registry(cluster, image, handles,
                                                                            tmp_path, flavor, request):
    """Over a ConfigMap's limit: the tree is built into `<workdir.image>:workdir-HASH` FROM the
    job's image and loaded into the testbed's nodes (no registry); the pods run it from /workdir
    (a TrainJob, which sets no working directory, from the image's WORKDIR); no ConfigMap."""
    import subprocess

    from deploy.testbed import k8s as testbed

    name = f"wd-image-{flavor}"
    path, snap = big_tree_job(tmp_path, name, flavor)
    tag = snap.image(f"ddpkit-workdir/{name}", IMAGE)
    request.addfinalizer(lambda: forget_image(tag))
    proc = ddpkit("submit", "k8s", str(path), env=cluster, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert f"ddpkit: workdir image {tag}: built in " in proc.stderr, proc.stderr
    assert "loaded into the testbed's nodes" in proc.stderr and f"as image {tag} (FROM {IMAGE})" in proc.stderr
    handle = proc.stdout.strip()
    handles.append(handle)
    status = k8s_wait(cluster, handle)
    logs = "".join(ddpkit("logs", handle, "--rank", str(r), env=cluster).stdout for r in (0, 1))
    assert status["state"] == "SUCCEEDED", (status, logs[-3000:])
    assert ran(logs) == {("0", "v1", "/workdir"), ("1", "v1", "/workdir")}, logs[-3000:]
    assert status["workdir"]["sha256"] == snap.digest
    got = subprocess.run([testbed.kubectl(), "get", "configmap", f"{name}-workdir"], env=cluster,
                         capture_output=True, text=True)
    assert got.returncode != 0 and "NotFound" in got.stderr, got.stdout
