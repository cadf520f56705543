"""Any valid job renders, for every flavor that can express it, to objects that pass lint.

Hypothesis draws job files across the fields the Kubernetes renderer reads (topology, GPUs,
resources, env with hostile strings, secrets, volumes of every kind, labels, annotations,
tolerations, scheduling); each rendering is linted against the upstream CRDs and the core
schemas, and the user's strings must come back unchanged.
"""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deploy.errors import UserError
from deploy.k8s import render as k8s
from deploy.lint import command as lint
from deploy.load import parse_job
from deploy.run.docker import controller_pods, resolve_env
from deploy.spec import reserved_env_reason
from tests.crds import crd_dir

NAME = st.from_regex(r"\A[a-z]([a-z0-9-]{0,16}[a-z0-9])?\Z")
DNS_LABEL = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?\Z")
ENV_NAME = st.from_regex(r"\A[A-Z][A-Z0-9_]{0,10}\Z").filter(lambda n: reserved_env_reason(n) is None)
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30)
LABEL_VALUE = st.from_regex(r"\A([A-Za-z0-9]([-A-Za-z0-9_.]{0,10}[A-Za-z0-9])?)?\Z")
PATH = st.from_regex(r"\A/[a-z]{1,8}(/[a-z0-9]{1,8}){0,2}\Z")


@st.composite
def volumes(draw):
    count = draw(st.integers(0, 3))
    names = draw(st.lists(DNS_LABEL.filter(lambda n: n not in ("dshm", "ddpkit-job")),
                          min_size=count, max_size=count, unique=True))
    mounts = draw(st.lists(PATH.filter(lambda p: not p.startswith(("/dev", "/etc"))),
                           min_size=count, max_size=count, unique=True))
    out = []
    for name, mount in zip(names, mounts, strict=True):
        source = draw(st.sampled_from(["claim", "host_path", "nfs", "empty_dir"]))
        vol = {"name": name, "mount": mount, "read_only": draw(st.booleans())}
        if source == "claim":
            vol["claim"] = draw(DNS_LABEL)
        elif source == "host_path":
            vol["host_path"] = draw(PATH)
        elif source == "nfs":
            vol["nfs"] = {"server": "nfs.example", "path": draw(PATH)}
        else:
            vol["empty_dir"] = {"medium": draw(st.sampled_from(["", "Memory"])),
                                "size_limit": draw(st.sampled_from(["1Gi", "500Mi"]))}
        out.append(vol)
    return out


@st.composite
def jobs(draw):
    gpus = draw(st.sampled_from([0, 0, 1, 4, 8]))
    low = draw(st.integers(1, 6))
    nodes = draw(st.one_of(st.just(low), st.just(f"{low}:{low + draw(st.integers(1, 3))}")))
    data = {
        "name": draw(NAME),
        "image": "registry.example/example/ddpkit:0.1",
        "nodes": nodes,
        "gpus_per_node": gpus,
        "resources": {"cpus_per_node": draw(st.sampled_from([None, 1, 2.5, 64])),
                      "memory": draw(st.sampled_from([None, "8Gi", "512Gi"])),
                      "shm": draw(st.sampled_from(["64Mi", "1Gi", "4Gi"]))},
        "env": draw(st.dictionaries(ENV_NAME, TEXT, max_size=3)),
        "secret_env": [{"name": n, "secret": draw(DNS_LABEL), "key": "k"}
                       for n in draw(st.lists(ENV_NAME, max_size=2, unique=True))],
        "volumes": draw(volumes()),
        "restarts": draw(st.integers(0, 5)),
        "time_limit": draw(st.sampled_from([None, "90m", "2d"])),
        "k8s": {
            "namespace": draw(DNS_LABEL),
            "labels": draw(st.dictionaries(st.sampled_from(["team", "example.com/owner"]), LABEL_VALUE, max_size=2)),
            "annotations": draw(st.dictionaries(st.sampled_from(["note", "example.com/why"]), TEXT, max_size=2)),
            "node_selector": draw(st.dictionaries(st.sampled_from(["pool", "kubernetes.io/arch"]), LABEL_VALUE, max_size=2)),
            "tolerations": draw(st.lists(st.fixed_dictionaries({
                "key": st.sampled_from(["gpu", "example.com/spot"]),
                "operator": st.just("Exists"),
                "effect": st.sampled_from(["NoSchedule", "NoExecute"])}), max_size=2)),
            "priority_class": draw(st.sampled_from([None, "high"])),
            "queue": draw(st.sampled_from([None, "team-q"])),
            "gang": draw(st.booleans()),
            "service_account": draw(st.sampled_from([None, "trainer"])),
            "image_pull_secrets": draw(st.lists(DNS_LABEL, max_size=2, unique=True)),
        },
    }
    if not gpus:
        data["procs_per_node"] = draw(st.integers(1, 4))
    data["secret_env"] = [s for s in data["secret_env"] if s["name"] not in data["env"]]
    data["checkpoint"] = {"ephemeral": True}  # where checkpoints live is not what this fuzzes
    try:
        return parse_job(data)
    except UserError:
        assume(False)


@pytest.fixture(scope="module")
def crds():
    return lint.load_crds(crd_dir())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(spec=jobs())
def test_any_valid_job_renders_to_objects_that_pass_lint(spec, crds):
    rendered = 0
    for flavor in k8s.FLAVORS:
        try:
            text = k8s.render_k8s(spec, flavor=flavor)
        except UserError as err:
            assert err.problems and all(":" in p for p in err.problems)
            continue
        rendered += 1
        found = lint.lint_text(text, crds, source=flavor)
        # a TrainJob on the upstream runtime is told its pods' restarts are the runtime's
        assert [p for p in found if p.rule != "runtime-restarts"] == []
        objects = k8s.parse_objects(text)
        assert yaml.safe_load(objects[0]["data"]["job.yaml"]) == spec.model_dump(mode="json")
        for pod in controller_pods(objects):
            template = pod.template
            # what the process sees after the kubelet's $(VAR) expansion: exactly what was written
            env = resolve_env(pod, template["spec"]["containers"][0], objects,
                              {s.name: "secret" for s in spec.secret_env})
            assert all(env[k] == v for k, v in spec.env.items())
            assert all(template["metadata"]["annotations"][k] == v for k, v in spec.k8s.annotations.items())
    assert rendered >= 1  # pytorchjob expresses every valid job
