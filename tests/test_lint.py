"""deploy.lint: schema layers and one test per ddpkit rule."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy import lint
from tests.crds import crd_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def crds():
    return lint.load_crds(crd_dir())


def pytorchjob(gpus=2, nproc=2):
    """A small PyTorchJob that passes every check; tests break one thing at a time."""
    def pod(role):
        return {
            "metadata": {"labels": {"app.kubernetes.io/name": "ddpkit"}},
            "spec": {
                "containers": [{
                    "name": "pytorch", "image": "img:1",
                    "command": ["python", "-m", "trainer.launch"],
                    "env": [{"name": "DDPKIT_NPROC_PER_NODE", "value": str(nproc)}],
                    "resources": {"limits": {"nvidia.com/gpu": gpus},
                                  "requests": {"nvidia.com/gpu": gpus}},
                    "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                }],
                "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
            },
        }
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "demo", "labels": {"app.kubernetes.io/name": "ddpkit"}},
        "spec": {
            "nprocPerNode": str(nproc),
            "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod("Master")},
                "Worker": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod("Worker")},
            },
        },
    }


def problems(obj, crds, rule=None):
    found = lint.lint_object(obj, crds)
    return [p for p in found if rule is None or p.rule == rule]


def master_container(obj):
    return obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_valid_pytorchjob_has_no_problems(crds):
    assert problems(pytorchjob(), crds) == []


# ---- schema layers ---------------------------------------------------------------------------

def test_unknown_field_in_custom_resource_is_an_error_with_a_hint(crds):
    obj = pytorchjob()
    obj["spec"]["runPolicy"]["backofLimit"] = 3
    found = problems(obj, crds, "schema")
    assert [(p.path, p.message) for p in found] == [
        ("spec.runPolicy.backofLimit", "unknown field, did you mean 'backoffLimit'?")]


def test_wrong_type_in_custom_resource_is_an_error(crds):
    obj = pytorchjob()
    obj["spec"]["nprocPerNode"] = 2  # the CRD says string
    found = problems(obj, crds, "schema")
    assert len(found) == 1 and found[0].path == "spec.nprocPerNode"
    assert "expected string" in found[0].message


def test_enum_and_required_fields_of_a_crd_are_checked(crds):
    obj = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "js"},
           "spec": {"failurePolicy": {"restartStrategy": "Sometimes"},
                    "replicatedJobs": [{"name": "node"}]}}
    found = {(p.path, p.message.split(" ")[0]) for p in problems(obj, crds, "schema")}
    assert ("spec.failurePolicy.restartStrategy", "'Sometimes'") in found
    assert ("spec.replicatedJobs[0].template", "required") in found


def test_int_or_string_quantities_accept_both_and_check_the_pattern():
    schema = {"type": "object", "properties": {"q": {
        "anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
        "pattern": r"^[0-9]+(Gi|Mi)?$"}}}
    assert lint.validate_schema({"q": 2}, schema) == []
    assert lint.validate_schema({"q": "2Gi"}, schema) == []
    assert [p for p, _ in lint.validate_schema({"q": "two"}, schema)] == ["q"]
    assert [p for p, _ in lint.validate_schema({"q": [1]}, schema)] == ["q"]


def test_duplicate_list_map_keys_are_an_error(crds):
    obj = pytorchjob()
    master_container(obj)["env"].append({"name": "A", "value": "1"})
    master_container(obj)["env"].append({"name": "A", "value": "2"})
    assert any("duplicate" in p.message or "set twice" in p.message for p in problems(obj, crds))


def test_preserve_unknown_fields_and_embedded_resources_are_respected():
    schema = {"type": "object", "properties": {
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "emb": {"type": "object", "x-kubernetes-embedded-resource": True,
                "properties": {"spec": {"type": "object", "properties": {}}}},
        "closed": {"type": "object"}}}
    assert lint.validate_schema({"free": {"a": 1}, "emb": {"kind": "X", "apiVersion": "v1"}},
                                schema) == []
    assert lint.validate_schema({"closed": {"a": 1}}, schema) == [("closed.a", "unknown field")]


def test_unknown_field_in_a_core_kind_is_an_error():
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {},
          "dta": {}}
    found = problems(cm, None)
    assert len(found) == 1 and "'dta' was unexpected" in found[0].message


def test_pod_template_inside_a_custom_resource_is_checked_as_a_podtemplate(crds):
    obj = pytorchjob()
    master_container(obj)["resources"]["limits"]["memory"] = ["1Gi"]
    found = problems(obj, crds, "schema")
    assert any(p.message.endswith("(as a PodTemplate)") for p in found), found


def test_custom_kind_without_a_crd_is_an_error_not_a_pass(crds):
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    found = problems(obj, crds)
    assert len(found) == 1 and "no CRD for Widget" in found[0].message
    assert "no CRD for PyTorchJob" in problems(pytorchjob(), None)[0].message


def test_unknown_metadata_field_is_an_error(crds):
    obj = pytorchjob()
    obj["metadata"]["lables"] = {}
    assert [p.path for p in problems(obj, crds)] == ["metadata.lables"]


def test_crds_load_from_a_kubectl_list(tmp_path):
    one = yaml.safe_load((crd_dir() / "kubeflow.org_pytorchjobs.yaml").read_text())
    (tmp_path / "got.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List",
                                                       "items": [one]}))
    assert lint.load_crds(tmp_path).kinds == ["PyTorchJob.kubeflow.org/v1"]


# ---- one test per rule -------------------------------------------------------------------------

def test_rule_pytorch_container_must_exist(crds):
    obj = pytorchjob()
    master_container(obj)["name"] = "trainer"
    assert [p.path for p in problems(obj, crds, "pytorch-container")] == [
        "spec.pytorchReplicaSpecs.Master.template.spec.containers"]


def test_rule_master_replicas_is_one(crds):
    obj = pytorchjob()
    obj["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    assert [p.path for p in problems(obj, crds, "master-replicas")] == [
        "spec.pytorchReplicaSpecs.Master.replicas"]
    del obj["spec"]["pytorchReplicaSpecs"]["Master"]
    assert len(problems(obj, crds, "master-replicas")) == 1


def test_rule_processes_per_node_equal_gpu_limit(crds):
    obj = pytorchjob(gpus=4, nproc=2)
    found = problems(obj, crds, "nproc-gpus")
    assert len(found) == 2 and "4 GPUs but 2 processes per node" in found[0].message


def test_rule_gpu_requests_equal_limits(crds):
    obj = pytorchjob()
    master_container(obj)["resources"]["requests"]["nvidia.com/gpu"] = 1
    assert len(problems(obj, crds, "gpu-requests")) == 1


def test_rule_dev_shm_is_memory_backed(crds):
    obj = pytorchjob()
    pod = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["volumes"][0]["emptyDir"] = {}
    assert [p.path for p in problems(obj, crds, "dev-shm")] == [
        "spec.pytorchReplicaSpecs.Worker.template.spec"]
    master_container(obj)["volumeMounts"] = []
    assert len(problems(obj, crds, "dev-shm")) == 2


def test_rule_names_are_valid(crds):
    obj = pytorchjob()
    obj["metadata"]["name"] = "Demo_Job"
    obj["metadata"]["labels"]["bad key!"] = "ok"
    obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]["k"] = "x" * 64
    paths = [p.path for p in problems(obj, crds, "names")]
    assert paths == ["metadata.name", "metadata.labels",
                     "spec.pytorchReplicaSpecs.Worker.template.metadata.labels.k"]


def test_rule_owned_env_is_not_overridden(crds):
    obj = pytorchjob()
    env = master_container(obj)["env"]
    env.append({"name": "MASTER_ADDR", "value": "x"})
    env.append({"name": "DDPKIT_NPROC_PER_NODE", "value": "2"})
    messages = [p.message for p in problems(obj, crds, "env-owned")]
    assert messages == ["MASTER_ADDR is set by the launcher/operator; remove it from env",
                        "DDPKIT_NPROC_PER_NODE is set twice; the later value silently wins"]


def test_every_rule_has_a_test():
    text = Path(__file__).read_text()
    for rule in lint.RULES:
        assert f'"{rule}")' in text or f'rule == "{rule}"' in text, f"no test for lint rule {rule}"


# ---- CLI -----------------------------------------------------------------------------------------

def run_lint(*args):
    return subprocess.run([sys.executable, "-m", "deploy", "lint", *args], cwd=REPO,
                          capture_output=True, text=True)


def test_cli_lint_exit_codes(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(pytorchjob()))
    broken = copy.deepcopy(pytorchjob())
    broken["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 3
    bad.write_text(yaml.safe_dump(broken))
    ok = run_lint(str(good), "--crds", str(crd_dir()))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    fail = run_lint(str(bad), "--crds", str(crd_dir()))
    assert fail.returncode == 1
    assert "Master.replicas: must be 1, got 3" in fail.stdout
    missing = run_lint(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "nope.yaml: cannot read" in missing.stderr


def test_rule_restart_policy_is_counted_by_backoff_limit(crds):
    obj = pytorchjob()
    obj["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"
    assert [p.path for p in problems(obj, crds, "restart-policy")] == [
        "spec.pytorchReplicaSpecs.Worker.restartPolicy"]


def test_rule_names_pod_hostnames_fit_in_63_characters(crds):
    obj = pytorchjob()
    obj["metadata"]["name"] = "a" * 55
    obj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 12
    found = problems(obj, crds, "names")
    assert len(found) == 1 and f"pod hostname '{'a' * 55}-worker-11' is 65 characters" in found[0].message


@pytest.mark.parametrize(("flavor", "nodes"), [
    *((f, n) for f in ("pytorchjob", "trainjob", "jobset", "job") for n in (1, 3)),
    ("pytorchjob", "2:4"),  # elastic: workers only
])
def test_longest_hostname_is_the_longest_the_controllers_give(flavor, nodes):
    """lint's per-kind pod naming agrees with the controller emulation `--docker` runs."""
    from deploy.render.k8s import render_objects
    from deploy.spec import parse_job
    from deploy.submit.docker import controller_pods

    objs = render_objects(parse_job({"name": "demo", "image": "img:1", "nodes": nodes}),
                          flavor=flavor)
    workload = next(o for o in objs if o["kind"] in lint.TRAINING_KINDS)
    hostnames = [p.hostname for p in controller_pods(objs)]
    found = lint._longest_hostname(workload)
    assert found in hostnames and len(found) == max(len(h) for h in hostnames), (found, hostnames)

def indexed_job_file(**service_spec):
    from deploy.render.k8s import render_objects
    from deploy.spec import parse_job

    objs = render_objects(parse_job({"name": "demo", "image": "img:1", "nodes": 2}), flavor="job")
    svc = next(o for o in objs if o["kind"] == "Service")
    svc["spec"].update(service_spec)
    return objs


def test_rule_job_subdomain_is_a_headless_service_selecting_the_pods():
    assert lint.check_file_rules(indexed_job_file()) == []
    objs = indexed_job_file(clusterIP="10.0.0.1", publishNotReadyAddresses=False,
                            selector={"app": "other"})
    messages = [m for _, rule, _, m in lint.check_file_rules(objs) if rule == "job-subdomain"]
    assert len(messages) == 3
    without = [o for o in indexed_job_file() if o["kind"] != "Service"]
    [(_, rule, path, message)] = lint.check_file_rules(without)
    assert (rule, path) == ("job-subdomain", "spec.template.spec.subdomain")
    assert message.startswith("no Service 'demo' in this file")


def test_rule_replica_types_are_master_and_worker(crds):
    obj = pytorchjob()
    obj["spec"]["pytorchReplicaSpecs"]["worker"] = obj["spec"]["pytorchReplicaSpecs"].pop("Worker")
    assert [p.path for p in problems(obj, crds, "replica-types")] == ["spec.pytorchReplicaSpecs.worker"]


def test_rule_images_are_named(crds):
    obj = pytorchjob()
    del master_container(obj)["image"]
    assert [p.path for p in problems(obj, crds, "images")] == [
        "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].image"]
    from deploy.render.k8s import render_objects
    from deploy.spec import parse_job

    tj = next(o for o in render_objects(parse_job({"name": "d", "image": "i:1"}), flavor="trainjob")
              if o["kind"] == "TrainJob")
    del tj["spec"]["trainer"]["image"]
    assert [p.path for p in problems(tj, crds, "images")] == ["spec.trainer.image"]


def test_cli_lint_checks_core_kinds_against_a_chosen_kubernetes_version(tmp_path):
    cm = tmp_path / "cm.yaml"
    cm.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": {"name": "x"}, "data": {}}))
    assert run_lint(str(cm), "--k8s-version", "1.30").returncode == 0
    bad = run_lint(str(cm), "--k8s-version", "9.99")
    assert bad.returncode == 2 and "--k8s-version 9.99: not supported" in bad.stderr


def test_lint_never_crashes_on_malformed_objects(crds):
    """Replace random subtrees of rendered objects with values of the wrong type: lint reports
    problems, one line each, and never raises (a traceback would be a bug of ours)."""
    import random

    from deploy.render import k8s
    from deploy.spec import parse_job

    spec = parse_job({"name": "d", "image": "i:1", "nodes": 2, "gpus_per_node": 2})
    base = [o for flavor in k8s.FLAVORS for o in k8s.render_objects(spec, flavor=flavor)]

    def paths(value, prefix=()):
        yield prefix
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            yield from paths(child, (*prefix, key))

    rnd = random.Random(1234)
    reported = 0
    for _ in range(120):
        obj = copy.deepcopy(rnd.choice(base))
        path = rnd.choice([p for p in paths(obj) if p])
        node = obj
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = rnd.choice([None, 7, "x", [], {}, [1], {"a": 1}, True, 1.5])
        found = lint.lint_text(yaml.safe_dump(obj), crds, source="m.yaml")
        assert all(isinstance(p, lint.Problem) and "\n" not in str(p) for p in found)
        reported += bool(found)
    assert reported > 80, reported  # most wrong-type values are caught
