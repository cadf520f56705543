"""deploy.lint: each layer (schema, CEL, webhooks, core validation) and one test per advice rule.

Whether these verdicts are the API server's is tested against the real testbed in
tests/test_lint_corpus.py; here each rule is pinned by the smallest object that breaks it.
"""

import copy
import json
from pathlib import Path

import pytest
import yaml

from deploy.lint import advice, schema
from deploy.lint import command as lint
from tests.conftest import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def crds():
    return lint.load_crds()  # the bundled upstream CRDs


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


def jobset(name="js", **spec):
    pod = {"restartPolicy": "Never", "containers": [{"name": "c", "image": "img:1"}]}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name},
            "spec": {"replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": {
                "parallelism": 2, "completions": 2, "template": {"spec": pod}}}}], **spec}}


def trainjob(**trainer):
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "tj"},
            "spec": {"runtimeRef": {"name": "torch-distributed"},
                     "trainer": {"image": "img:1", "numNodes": 2, **trainer}}}


def job(**spec):
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
            "spec": {"template": {"spec": {"restartPolicy": "Never",
                                           "containers": [{"name": "c", "image": "img:1"}]}}, **spec}}


def problems(obj, crds, rule=None, severity=None):
    found = lint.lint_object(obj, crds)
    return [p for p in found if (rule is None or p.rule == rule) and (severity is None or p.severity == severity)]


def errors(obj, crds):
    return [(p.path, p.message) for p in problems(obj, crds, severity=lint.ERROR)]


def master_container(obj):
    return obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_valid_objects_have_no_problems(crds):
    assert problems(pytorchjob(), crds) == []
    assert errors(jobset(), crds) == []
    assert errors(trainjob(), crds) == []
    assert errors(job(), crds) == []


# ---- schema layer (jsonschema + x-kubernetes-*) ---------------------------------------------

def test_unknown_field_in_custom_resource_is_an_error_with_a_hint(crds):
    obj = pytorchjob()
    obj["spec"]["runPolicy"]["backofLimit"] = 3
    assert errors(obj, crds) == [("spec.runPolicy.backofLimit", "unknown field, did you mean 'backoffLimit'?")]


def test_wrong_type_in_custom_resource_is_an_error(crds):
    obj = pytorchjob()
    obj["spec"]["nprocPerNode"] = 2  # the CRD says string
    found = errors(obj, crds)
    assert len(found) == 1 and found[0][0] == "spec.nprocPerNode" and "must be of type string" in found[0][1]


def test_enum_and_required_fields_of_a_crd_are_checked(crds):
    obj = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "js"},
           "spec": {"failurePolicy": {"restartStrategy": "Sometimes"}, "replicatedJobs": [{"name": "node"}]}}
    found = {(p, msg.split(":")[0]) for p, msg in errors(obj, crds)}
    assert ("spec.failurePolicy.restartStrategy", "Unsupported value") in found
    # The mutating webhook (Go structs) fills template.spec.template.spec: only containers lack.
    assert ("spec.replicatedJobs[0].template.spec.template.spec.containers", "Required value") in found


def test_int_or_string_nullable_and_int32_range():
    s = {"type": "object", "properties": {
        "q": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
              "pattern": r"^[0-9]+(Gi|Mi)?$"},
        "n": {"type": "integer", "format": "int32", "nullable": True}}}
    assert schema.validate_values({"q": 2, "n": None}, s) == []
    assert schema.validate_values({"q": "2Gi"}, s) == []
    assert [p for p, _, _ in schema.validate_values({"q": "two"}, s)] == ["q"]
    assert [p for p, _, _ in schema.validate_values({"q": [1]}, s)] == ["q"]
    assert schema.validate_values({"n": 2**31}, s) == []  # the API server alone accepts it
    assert [(p, r) for p, _, r in schema.validate_values({"n": 2**31}, s, typed=True)] == [("n", "webhook")]


def test_list_type_map_and_set_are_unique():
    s = {"type": "object", "properties": {
        "m": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
              "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "s": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}}}}
    found = schema.validate_values({"m": [{"name": "a"}, {"name": "a"}], "s": ["x", "x"]}, s)
    assert [(p, msg.split(":")[0]) for p, msg, _ in found] == [("m[1]", "Duplicate value"), ("s[1]", "Duplicate value")]


def test_pruning_keeps_preserved_and_embedded_fields_and_drops_nulls():
    s = {"type": "object", "properties": {
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "emb": {"type": "object", "x-kubernetes-embedded-resource": True,
                "properties": {"spec": {"type": "object", "properties": {}}}},
        "closed": {"type": "object"}, "gone": {"type": "string"}}}
    pruned, unknown = schema.prune({"free": {"a": 1}, "emb": {"kind": "X", "apiVersion": "v1", "spec": {"b": 1}},
                                    "closed": {"a": 1}, "gone": None}, s)
    assert unknown == ["emb.spec.b", "closed.a"]
    assert pruned == {"free": {"a": 1}, "emb": {"kind": "X", "apiVersion": "v1", "spec": {}}, "closed": {}}


def test_crd_defaults_are_applied_before_the_webhooks(crds):
    obj = jobset()  # no groupName, no replicas default: the CRD fills groupName "default"
    del obj["spec"]["replicatedJobs"][0]["replicas"]
    assert errors(obj, crds) == []
    pruned, _ = schema.check_custom_resource(obj, crds.lookup(obj["apiVersion"], "JobSet")["schema"])
    assert pruned["spec"]["replicatedJobs"][0]["groupName"] == "default"
    assert pruned["spec"]["replicatedJobs"][0]["replicas"] == 1


def test_unknown_field_in_a_core_kind_is_an_error(crds):
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {}, "dta": {}}
    assert errors(cm, crds) == [("dta", "unknown field")]


def test_custom_kind_without_a_crd_is_an_error_not_a_pass(crds):
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    [(path, message)] = errors(obj, crds)
    assert "no CRD for Widget" in message and "no matches for kind" in message


def test_unknown_metadata_field_is_an_error(crds):
    obj = pytorchjob()
    obj["metadata"]["lables"] = {}
    assert errors(obj, crds) == [("metadata.lables", "unknown field")]


def test_crds_load_from_a_kubectl_list_and_take_precedence(tmp_path):
    one = yaml.safe_load((schema.BUNDLED_CRDS / "kubeflow.org_pytorchjobs.yaml").read_text())
    one["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["extra"] = {"type": "string"}
    (tmp_path / "got.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [one]}))
    assert lint.load_crds(tmp_path, bundled=False).kinds == ["PyTorchJob.kubeflow.org/v1"]
    obj = pytorchjob()
    obj["spec"]["extra"] = "x"
    assert errors(obj, lint.load_crds(tmp_path)) == []
    assert errors(obj, lint.load_crds())[0][1] == "unknown field"


# ---- CEL (x-kubernetes-validations) ---------------------------------------------------------

def test_cel_rules_of_the_crd_are_evaluated(crds):
    obj = trainjob()
    obj["metadata"]["name"] = "1-tj"  # a DNS-1123 subdomain, but the CRD's rule wants RFC 1035
    found = [p for p in problems(obj, crds) if p.rule == "cel"]
    assert [p.message for p in found] == ['Invalid value: "object": metadata.name must match RFC 1035 DNS label format']
    js = jobset(startupPolicy={"startupPolicyOrder": "InOrder"})
    js["spec"]["replicatedJobs"].append({**copy.deepcopy(js["spec"]["replicatedJobs"][0]), "name": "w",
                                         "dependsOn": [{"name": "node", "status": "Ready"}]})
    assert [p.message for p in problems(js, crds, "cel")] == [
        'Invalid value: "object": StartupPolicy and DependsOn APIs are mutually exclusive']


def test_transition_rules_are_not_evaluated_on_create(crds):
    obj = trainjob()
    obj["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"  # `self == oldSelf` rules sit here too
    assert errors(obj, crds) == []
    obj["spec"]["managedBy"] = "me.io/x"
    assert [m for _, m in errors(obj, crds)] == ['Invalid value: "string": ManagedBy must be '
                                                 'trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue if set']


# ---- admission webhooks ---------------------------------------------------------------------

def test_pytorchjob_webhook_rules(crds):
    obj = pytorchjob()
    del obj["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"]  # no CRD default: nil != 1
    obj["spec"]["pytorchReplicaSpecs"]["worker"] = obj["spec"]["pytorchReplicaSpecs"].pop("Worker")
    master_container(obj)["name"] = "trainer"
    found = {(p.path, p.message.split(":")[0]) for p in problems(obj, crds, "webhook")}
    assert found == {
        ("spec.pytorchReplicaSpecs[Master].replicas", "Forbidden"),
        ("spec.pytorchReplicaSpecs[worker]", "Unsupported value"),
        ("spec.pytorchReplicaSpecs[Master].template.spec.containers", "Required value")}
    obj = pytorchjob()
    obj["metadata"]["name"] = "0-demo"
    obj["spec"]["elasticPolicy"] = {"nProcPerNode": 2}
    del obj["spec"]["pytorchReplicaSpecs"]["Worker"]
    del master_container(obj)["image"]
    paths = sorted(p.path for p in problems(obj, crds, "webhook", lint.ERROR))
    assert paths == ["metadata.name", "spec.elasticPolicy.nProcPerNode",
                     "spec.pytorchReplicaSpecs[Master].template.spec.containers[0].image",
                     "spec.pytorchReplicaSpecs[Worker]"]
    assert [p.path for p in problems(obj, crds, "webhook", lint.WARNING)] == ["spec.elasticPolicy.nProcPerNode"]


def test_jobset_webhook_defaults_then_validates(crds):
    # completionMode is defaulted to Indexed by the mutating webhook: then the pod-name rule applies.
    long = jobset(name="a" * 49)  # a-...-node-0-1-abcde: 64 characters
    assert [m.split(": ")[-1] for _, m in errors(long, crds)] == [
        "JobSet name is too long, pod names generated for this JobSet will exceed 63 characters"]
    js = jobset(failurePolicy={"restartStrategy": "InPlaceRestart",
                               "rules": [{"name": "same", "action": "FailJobSet"}, {"name": "same", "action": "FailJobSet"}]},
                successPolicy={"operator": "All", "targetReplicatedJobs": ["nope"]})
    js["spec"]["replicatedJobs"][0]["dependsOn"] = [{"name": "x", "status": "Complete"}]
    messages = sorted(p.message for p in problems(js, crds, "webhook"))
    assert messages == [
        "DependsOn can't be set for the first ReplicatedJob",
        "InPlaceRestart restart strategy cannot be set when InPlaceRestart feature gate is disabled",
        "invalid replicatedJob name 'nope' does not appear in .spec.ReplicatedJobs",
        "replicatedJob: node cannot depend on replicatedJob: x",
        "rule names are not unique, rules with indices [0 1] all have the same name 'same'"]


def test_trainjob_webhook_needs_its_runtime_and_refuses_reserved_env(crds):
    assert errors(trainjob(env=[{"name": "PET_NNODES", "value": "3"}]), crds) == [
        ("spec.trainer.env", 'Invalid value: [{\'name\': \'PET_NNODES\', \'value\': \'3\'}]: '
                             "must not have reserved envs, invalid envs configured: [PET_NNODES]")]
    missing = trainjob()
    missing["spec"]["runtimeRef"]["name"] = "nope"
    [(path, message)] = errors(missing, crds)
    assert "specified clusterTrainingRuntime must be created before the TrainJob is created" in message
    patched = trainjob()
    patched["spec"]["runtimePatches"] = [{"manager": "ddpkit"}]
    assert [m for _, m in errors(patched, crds)] == [
        'Invalid value: "ddpkit": must be a domain-prefixed path (such as "acme.io/foo")']


def flux_runtime(init_containers=()):
    pod = {"containers": [{"name": "node", "image": "i"}]}
    if init_containers:
        pod["initContainers"] = [{"name": n, "image": "i"} for n in init_containers]
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
            "metadata": {"name": "flux"}, "spec": {"mlPolicy": {"numNodes": 1, "flux": {}}, "template": {"spec": {
                "replicatedJobs": [{"name": "node", "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"template": {"spec": pod}}}}]}}}}


def test_trainjob_plugin_rules_initializer_sections_and_flux(crds):
    """Trainer v2.3.0 plugins' Validate: the JobSet plugin asks for an initializer job when a
    section is there at all (`Initializer.Dataset != nil`: `dataset: {}` counts); the Flux
    plugin wants numProcPerNode >= 1 and keeps the init container `flux-installer` for itself."""
    empty = trainjob()
    empty["spec"]["initializer"] = {"dataset": {}, "model": {}}
    assert [m for _, m in errors(empty, crds)] == [
        "must have dataset-initializer job when trainJob is configured with input datasetConfig",
        "must have model-initializer job when trainJob is configured with input modelConfig"]
    none = trainjob()
    none["spec"]["initializer"] = {}
    assert errors(none, crds) == []

    def flux_errors(runtime, **trainer):
        tj = trainjob(**trainer)
        tj["spec"]["runtimeRef"] = {"name": "flux"}
        found = lint.lint_text(yaml.safe_dump_all([runtime, tj]), crds)
        return [(p.path, p.message) for p in found if p.severity == lint.ERROR]
    assert flux_errors(flux_runtime()) == []
    assert flux_errors(flux_runtime(), numProcPerNode=0) == [
        ("spec.trainer.numProcPerNode", "Invalid value: 0: must be greater than or equal to 1 for Flux TrainJob")]
    assert flux_errors(flux_runtime(["flux-installer"])) == [
        ("spec.trainer.initContainers", "Invalid value: \"flux-installer\": InitContainer 'flux-installer' is reserved")]
    assert flux_errors(flux_runtime(["warmup"])) == []


def test_runtime_webhook_skips_a_runtime_labelled_validation_disabled(crds):
    """manifests/base/webhook/patch_validating.yaml: the runtime webhooks' objectSelector."""
    runtime = flux_runtime()
    runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["replicas"] = 2
    assert [p for p, _ in errors(runtime, crds)] == ["spec.template.spec.replicatedJobs[0].replicas"]
    runtime["metadata"]["labels"] = {"trainer.kubeflow.org/webhook-validation": "disabled"}
    assert errors(runtime, crds) == []


def test_trainjob_runtime_can_come_from_the_same_file(crds):
    runtime = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
               "metadata": {"name": "mine", "namespace": "default"},
               "spec": {"mlPolicy": {"torch": {}}, "template": {"spec": {"replicatedJobs": [{
                   "name": "node", "template": {"metadata": {"labels": {
                       "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                       "spec": {"template": {"spec": {"containers": [{"name": "node", "image": "i"}]}}}}}]}}}}
    tj = trainjob()
    tj["spec"]["runtimeRef"] = {"name": "mine", "kind": "TrainingRuntime", "apiGroup": "trainer.kubeflow.org"}
    text = yaml.safe_dump_all([runtime, tj])
    assert [p for p in lint.lint_text(text, crds) if p.severity == lint.ERROR] == []
    assert any("must be created" in p.message for p in lint.lint_text(yaml.safe_dump(tj), crds))


# ---- core kinds: the API server's own validation ---------------------------------------------

def test_job_rules_of_the_api_server(crds):
    bad = job(completionMode="Indexed", parallelism=2)  # completions is defaulted only without both
    bad["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    bad["spec"]["template"]["spec"]["tolerations"] = [{"key": "k", "operator": "Exists", "effect": "NoSchedule",
                                                       "tolerationSeconds": 5}]
    assert sorted(p for p, _ in errors(bad, crds)) == [
        "spec.completions", "spec.template.spec.restartPolicy", "spec.template.spec.tolerations[0].effect"]
    named = job(completionMode="Indexed", completions=100, parallelism=100)
    named["metadata"]["name"] = "j" * 61
    assert [m for _, m in errors(named, crds)] == [
        f'Invalid value: "{"j" * 61}": will not able to create pod with invalid DNS label: {"j" * 61}-99']


def test_job_indexed_counts_and_max_failed_indexes(crds):
    """validateJobSpec (kubernetes 1.34 pkg/apis/batch/validation): maxFailedIndexes needs
    Indexed mode and backoffLimitPerIndex, is at most completions and 100000; above 100000
    completions with backoffLimitPerIndex it is required and capped at 10000."""
    indexed = {"completionMode": "Indexed", "backoffLimitPerIndex": 1}
    assert errors(job(completions=4, parallelism=4, maxFailedIndexes=4, **indexed), crds) == []
    assert errors(job(completions=4, parallelism=4, maxFailedIndexes=5, **indexed), crds) == [
        ("spec.maxFailedIndexes", "Invalid value: 5: must be less than or equal to completions")]
    assert errors(job(completions=4, maxFailedIndexes=1, completionMode="Indexed"), crds) == [
        ("spec.backoffLimitPerIndex", "Required value: when maxFailedIndexes is specified")]
    assert errors(job(completions=4, maxFailedIndexes=1, backoffLimitPerIndex=1), crds) == [
        ("spec.backoffLimitPerIndex", "Invalid value: 1: requires indexed completion mode"),
        ("spec.maxFailedIndexes", "Invalid value: 1: requires indexed completion mode")]
    huge = job(completions=200_000, parallelism=20_000, maxFailedIndexes=150_000, **indexed)
    assert sorted(errors(huge, crds)) == [
        ("spec.maxFailedIndexes", "Invalid value: 150000: must be less than or equal to 10000 when "
                                  "completions are above 100000 and used with backoff limit per index"),
        ("spec.maxFailedIndexes", "Invalid value: 150000: must be less than or equal to 100000"),
        ("spec.parallelism", "Invalid value: 20000: must be less than or equal to 10000 when "
                             "completions are above 100000 and used with backoff limit per index")]
    assert errors(job(completions=200_000, parallelism=10, **indexed), crds) == [
        ("spec.maxFailedIndexes", "Required value: must be specified when completions is above 100000")]


def test_pod_host_network_ports_and_dns_config(crds):
    """validatePodHostNetworkDeps and validatePodDNSConfig (kubernetes 1.34
    pkg/apis/core/validation): under hostNetwork a set hostPort equals containerPort; dnsPolicy
    None needs a dnsConfig with a nameserver; at most 3 nameservers."""
    ok = job()
    pod = ok["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    pod["containers"][0]["ports"] = [{"containerPort": 29500}, {"containerPort": 8080, "hostPort": 8080}]
    pod["dnsPolicy"] = "None"
    pod["dnsConfig"] = {"nameservers": ["10.0.0.10"], "searches": ["svc.cluster.local"]}
    assert errors(ok, crds) == []
    bad = copy.deepcopy(ok)
    pod = bad["spec"]["template"]["spec"]
    pod["containers"][0]["ports"][1]["hostPort"] = 9090
    pod["dnsConfig"] = {"searches": ["svc.cluster.local"]}
    assert errors(bad, crds) == [
        ("spec.template.spec.containers[0].ports[1].hostPort",
         "Invalid value: 9090: must match `containerPort` when `hostNetwork` is true"),
        ("spec.template.spec.dnsConfig.nameservers",
         "Required value: must provide at least one DNS nameserver when `dnsPolicy` is None")]
    del pod["dnsConfig"]
    assert ("spec.template.spec.dnsConfig", "Required value: must provide `dnsConfig` when `dnsPolicy` is None"
            ) in errors(bad, crds)
    pod["dnsPolicy"], pod["dnsConfig"] = "ClusterFirst", {"nameservers": ["1.1.1.1", "1.0.0.1", "8.8.8.8", "8.8.4.4"]}
    assert [p for p, _ in errors(bad, crds)][1:] == ["spec.template.spec.dnsConfig.nameservers"]
    pod["hostNetwork"] = False  # without host networking any hostPort is the pod's own business
    assert [p for p, _ in errors(bad, crds)] == ["spec.template.spec.dnsConfig.nameservers"]


def test_job_pod_replacement_policy_is_failed_when_a_pod_failure_policy_is_set(crds):
    """kubernetes pkg/apis/batch/validation validatePodReplacementPolicy."""
    pfp = {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}
    assert errors(job(podReplacementPolicy="Failed", podFailurePolicy=pfp), crds) == []
    assert errors(job(podReplacementPolicy="TerminatingOrFailed"), crds) == []
    assert errors(job(podReplacementPolicy="TerminatingOrFailed", podFailurePolicy=pfp), crds) == [
        ("spec.podReplacementPolicy", 'Unsupported value: "TerminatingOrFailed": supported values: "Failed"')]
    assert errors(job(podReplacementPolicy="Never"), crds) == [
        ("spec.podReplacementPolicy",
         'Unsupported value: "Never": supported values: "Failed", "TerminatingOrFailed"')]


def test_pod_spec_rules_judge_core_pods_and_warn_for_custom_resources(crds):
    bad = job()
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["volumeMounts"] = [{"name": "missing", "mountPath": "/x"}]
    container["resources"] = {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 2}}
    assert [p for p, _ in errors(bad, crds)] == [
        "spec.template.spec.containers[0].volumeMounts[0].name",
        "spec.template.spec.containers[0].resources.requests.nvidia.com/gpu",
        "spec.template.spec.containers[0].resources.requests.nvidia.com/gpu"]
    obj = pytorchjob()
    master_container(obj)["resources"]["requests"]["nvidia.com/gpu"] = 1
    found = problems(obj, crds, "pod-template")
    assert [p.severity for p in found] == [lint.WARNING] and "controller's pods will be refused" in found[0].message


def test_service_needs_ports_unless_headless(crds):
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"selector": {"a": "b"}}}
    assert errors(svc, crds) == [("spec.ports", "Required value")]
    svc["spec"]["clusterIP"] = "None"
    assert errors(svc, crds) == []


# ---- ddpkit's advice (warnings), one test per rule -------------------------------------------

def test_rule_dev_shm_is_memory_backed(crds):
    obj = pytorchjob()
    pod = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["volumes"][0]["emptyDir"] = {}
    assert [(p.path, p.severity) for p in problems(obj, crds, "dev-shm")] == [
        ("spec.pytorchReplicaSpecs[Worker].template.spec", lint.WARNING)]
    plain = jobset()  # a container that does not run torch gets no /dev/shm advice
    assert problems(plain, crds, "dev-shm") == []
    # only where processes share memory: ddpkit's trainer (DataLoader workers) or several GPUs
    script = pytorchjob(gpus=1, nproc=1)
    for role in ("Master", "Worker"):
        pod = script["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
        pod["containers"][0]["command"] = ["python", "/opt/mnist.py"]
        del pod["volumes"], pod["containers"][0]["volumeMounts"]
    assert problems(script, crds, "dev-shm") == []  # upstream's examples look like this
    master_container(script)["resources"] = {"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 2}}
    assert [p.path for p in problems(script, crds, "dev-shm")] == ["spec.pytorchReplicaSpecs[Master].template.spec"]
    assert problems(trainjob(command=["torchrun", "train.py"]), crds, "dev-shm") == []
    assert [p.path for p in problems(trainjob(command=["python", "-m", "trainer.launch"]), crds, "dev-shm")] == [
        "spec.runtimePatches"]


def test_rule_env_owned_only_where_the_controller_owns_it(crds):
    obj = pytorchjob()
    master_container(obj)["env"].append({"name": "MASTER_ADDR", "value": "x"})
    master_container(obj)["env"].append({"name": "TORCHELASTIC_RUN_ID", "value": "x"})
    assert [p.message.split(" ")[0] for p in problems(obj, crds, "env-owned")] == ["MASTER_ADDR", "TORCHELASTIC_RUN_ID"]
    js = jobset()  # a JobSet's own MASTER_ADDR is how JobSet users do it: no advice
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "MASTER_ADDR", "value": "js-node-0-0.js"}]
    assert problems(js, crds, "env-owned") == []


def test_rule_runtime_restarts_only_for_the_upstream_runtime(crds):
    assert [(p.path, p.severity) for p in problems(trainjob(), crds, "runtime-restarts")] == [
        ("spec.runtimeRef", lint.WARNING)]
    assert "up to 5 times" in problems(trainjob(), crds, "runtime-restarts")[0].message
    other = trainjob()
    other["spec"]["runtimeRef"] = {"name": "my-torch"}  # a runtime we know nothing about
    assert problems(other, crds, "runtime-restarts") == []


def test_rule_env_duplicate(crds):
    obj = job()  # core pods accept a duplicate (the API server only warns)
    obj["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]
    assert [p.message for p in problems(obj, crds, "env-duplicate")] == ["A is set twice; the later value silently wins"]
    cr = pytorchjob()  # in a CRD the env list is a list-map: the server refuses the duplicate
    master_container(cr)["env"].append({"name": "DDPKIT_NPROC_PER_NODE", "value": "2"})
    assert [p.message.split(":")[0] for p in problems(cr, crds, severity=lint.ERROR)] == ["Duplicate value"]


def test_rule_nproc_gpus(crds):
    found = problems(pytorchjob(gpus=4, nproc=2), crds, "nproc-gpus")
    assert len(found) == 2 and "4 GPUs but 2 processes per node" in found[0].message


def test_rule_restart_policy(crds):
    obj = pytorchjob()
    obj["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"
    assert [p.path for p in problems(obj, crds, "restart-policy")] == ["spec.pytorchReplicaSpecs[Worker].restartPolicy"]


def test_rule_hostnames(crds):
    obj = pytorchjob()
    obj["metadata"]["name"] = "a" * 55
    obj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 12
    found = problems(obj, crds, "hostnames")
    assert len(found) == 1 and f"pod hostname '{'a' * 55}-worker-11' is 65 characters" in found[0].message


def test_rule_pod_template(crds):
    obj = jobset()
    obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["name"] = "Bad_Name"
    found = problems(obj, crds, "pod-template")
    assert [p.path for p in found] == ["spec.replicatedJobs[0].template.spec.template.spec.containers[0].name"]


def indexed_job_file(**service_spec):
    from deploy.k8s.render import render_objects
    from deploy.load import parse_job

    objs = render_objects(parse_job({"name": "demo", "image": "img:1", "nodes": 2, "checkpoint": {"ephemeral": True}}), flavor="job")
    svc = next(o for o in objs if o["kind"] == "Service")
    svc["spec"].update(service_spec)
    return objs


def test_rule_job_subdomain_is_a_headless_service_selecting_the_pods():
    assert advice.advise_file(indexed_job_file()) == []
    objs = indexed_job_file(clusterIP="10.0.0.1", publishNotReadyAddresses=False, selector={"app": "other"})
    assert [rule for _, rule, _, _ in advice.advise_file(objs)] == ["job-subdomain"] * 3
    without = [o for o in indexed_job_file() if o["kind"] != "Service"]
    [(_, rule, path, message)] = advice.advise_file(without)
    assert (rule, path) == ("job-subdomain", "spec.template.spec.subdomain")
    assert message.startswith("no Service 'demo' in this file")


def test_every_rule_has_a_test():
    text = Path(__file__).read_text()
    for rule in advice.RULES:
        assert f"def test_rule_{rule.replace('-', '_')}" in text, f"no test for advice rule {rule}"
    assert set(advice.RULES) <= set(lint.RULES)


@pytest.mark.parametrize(("flavor", "nodes"), [
    *((f, n) for f in ("pytorchjob", "trainjob") for n in (1, 3)),
    ("pytorchjob", "2:4"),  # elastic: workers only
])
def test_longest_hostname_is_the_longest_the_controllers_give(flavor, nodes):
    """lint's per-kind pod naming agrees with the controller emulation `--docker` runs."""
    from deploy.k8s.render import render_objects
    from deploy.load import parse_job
    from deploy.run.docker import controller_pods

    objs = render_objects(parse_job({"name": "demo", "image": "img:1", "nodes": nodes,
                                            "checkpoint": {"ephemeral": True}}), flavor=flavor)
    workload = next(o for o in objs if o["kind"] in ("PyTorchJob", "TrainJob"))
    hostnames = [p.hostname for p in controller_pods(objs)]
    found = advice.longest_hostname(workload)
    assert found in hostnames and len(found) == max(len(h) for h in hostnames), (found, hostnames)


# ---- CLI -----------------------------------------------------------------------------------------

def run_lint(*args):
    return cli("lint", *args)


def test_cli_lint_exit_codes(tmp_path):
    good, warn, bad = tmp_path / "good.yaml", tmp_path / "warn.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(pytorchjob()))
    advised = pytorchjob()
    advised["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"
    warn.write_text(yaml.safe_dump(advised))
    broken = copy.deepcopy(pytorchjob())
    broken["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 3
    bad.write_text(yaml.safe_dump(broken))
    ok = run_lint(str(good))
    assert ok.returncode == 0 and ok.stdout == "", ok.stdout + ok.stderr
    warned = run_lint(str(warn))
    assert warned.returncode == 0 and ": warning: " in warned.stdout and "[restart-policy]" in warned.stdout
    assert run_lint(str(warn), "--strict").returncode == 1
    fail = run_lint(str(bad))
    assert fail.returncode == 1
    assert "error: spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1 [webhook]" in fail.stdout
    missing = run_lint(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "nope.yaml: cannot read" in missing.stderr
    assert run_lint(str(good), "--crds", str(tmp_path / "nope")).returncode == 2


def test_cli_lint_checks_core_kinds_against_a_chosen_kubernetes_version(tmp_path):
    cm = tmp_path / "cm.yaml"
    cm.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {}}))
    assert run_lint(str(cm), "--k8s-version", "1.30").returncode == 0
    bad = run_lint(str(cm), "--k8s-version", "9.99")
    assert bad.returncode == 2 and "--k8s-version 9.99: not supported" in bad.stderr


def test_lint_never_crashes_on_malformed_objects(crds):
    """Replace random subtrees of rendered objects with values of the wrong type: lint reports
    problems, one line each, and never raises (a traceback would be a bug of ours)."""
    import random

    from deploy.k8s import render as k8s
    from deploy.load import parse_job

    spec = parse_job({"name": "d", "image": "i:1", "nodes": 2, "gpus_per_node": 2, "checkpoint": {"ephemeral": True}})
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
        assert all(isinstance(p, lint.LintFinding) and "\n" not in str(p) for p in found)
        reported += bool(found)
    assert reported > 60, reported  # most wrong-type values are caught (nulls are pruned, as on the server)


def test_a_crash_in_ddpkit_s_own_rule_is_a_bug_not_the_user_s_bad_input(crds, monkeypatch):
    """A rule that raises on an object the schema layer accepted is ddpkit's bug: LintBug with
    the original exception chained, never a finding that blames the manifest."""
    from deploy.k8s import render as k8s
    from deploy.lint import admission
    from deploy.lint.report import LintBug
    from deploy.load import parse_job

    job = parse_job({"name": "d", "image": "i:1", "nodes": 2, "checkpoint": {"ephemeral": True}})
    (pytorchjob,) = [o for o in k8s.render_objects(job, flavor="pytorchjob") if o["kind"] == "PyTorchJob"]
    assert lint.lint_object(pytorchjob, crds) == []
    key = ("kubeflow.org", "PyTorchJob")

    def broken(obj, context=None):
        return obj["spec"]["no-such-field"]

    monkeypatch.setitem(admission.WEBHOOKS, key, admission.WEBHOOKS[key]._replace(validate=broken))
    with pytest.raises(LintBug, match="crashed on an object no rule refused") as raised:
        lint.lint_object(pytorchjob, crds)
    assert isinstance(raised.value.__cause__, KeyError)


# The fast pass (deploy/lint/schema.py and deploy/kube/core.py `_holds`): it only spares
# jsonschema the objects jsonschema finds nothing against, so no finding changes.

def test_the_fast_pass_knows_which_keywords_jsonschema_acts_on():
    import jsonschema

    from deploy.kube import core

    assert schema.DRAFT4_KEYWORDS == set(jsonschema.Draft4Validator.VALIDATORS)
    assert core.DRAFT2020_KEYWORDS == set(jsonschema.Draft202012Validator.VALIDATORS)


def test_the_newest_kubernetes_version_is_read_as_kubernetes_validate_reads_it(monkeypatch):
    from deploy.kube import core

    newest = core.resolve_version(None)
    monkeypatch.setattr(core, "_newest_schemas", lambda: None)
    assert newest == core.resolve_version(None) == core.resolve_version("") and newest.count(".") == 2


def _corpus_objects() -> list:
    return [doc for path in sorted((REPO / "tests" / "lint_corpus").rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict)]


def _without_fast_pass(monkeypatch):
    from deploy.kube import core

    monkeypatch.setattr(schema, "_holds", lambda *_: False)
    monkeypatch.setattr(core, "_schema_holds", lambda *_: False)


def test_the_fast_pass_changes_no_finding_of_the_corpus(monkeypatch):
    """Every file of the corpus (upstream manifests, ddpkit's renderings, one break per rule)
    lints the same with the fast pass and without it; most objects pass it."""
    from deploy.kube import core

    files = sorted(str(p) for p in (REPO / "tests" / "lint_corpus").rglob("*.yaml"))
    passed = []
    for module, name in ((schema, "_holds"), (core, "_schema_holds")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real: passed.append(real(*a)) or passed[-1])
    fast = [lint.lint_files([f]) for f in files]
    assert sum(passed) > len(passed) / 2, (sum(passed), len(passed))
    _without_fast_pass(monkeypatch)
    assert [lint.lint_files([f]) for f in files] == fast


def test_the_fast_pass_passes_only_what_jsonschema_passes(crds, monkeypatch):
    """A value of another type, a string of another length or pattern, a number out of its
    bounds, an unknown key or a null at any place of the corpus' objects: lint finds the same
    with the fast pass and without it."""
    import random

    def places(value, prefix=()):
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            yield (*prefix, key), child
            yield from places(child, (*prefix, key))

    def variants(value):
        if isinstance(value, str):
            return [value + "-X", "", value * 40, 7]
        if isinstance(value, bool):
            return [not value, "true"]
        if isinstance(value, (int, float)):
            return [-1, 2**40, 0.5, str(value)]
        return [None, [], {}, {"unknownField": 1}] + ([value[:1] * 2] if isinstance(value, list) else [])

    rnd = random.Random(4321)
    objects = [o for o in _corpus_objects() if isinstance(o.get("kind"), str)]
    cases = []
    for _ in range(400):
        obj = rnd.choice(objects)
        path, value = rnd.choice(list(places(obj)) or [((), None)])
        if not path:
            continue
        mutated = copy.deepcopy(obj)
        node = mutated
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = rnd.choice(variants(value))
        cases.append(mutated)

    def judge(obj):
        try:
            return lint.lint_object(copy.deepcopy(obj), crds)
        except Exception as exc:  # noqa: BLE001 - the same crash either way
            return repr(exc)

    fast = [judge(o) for o in cases]
    _without_fast_pass(monkeypatch)
    assert [judge(o) for o in cases] == fast


def test_crds_without_their_descriptions_judge_as_the_whole_files(tmp_path, monkeypatch):
    """The CRD cache keeps the schemas without their descriptions (schema._lean): the corpus
    lints the same as with the upstream files whole."""
    files = sorted(str(p) for p in (REPO / "tests" / "lint_corpus").rglob("*.yaml"))
    lean = [lint.lint_files([f]) for f in files]
    monkeypatch.setattr(schema, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(schema, "_lean", lambda doc: doc)
    assert [lint.lint_files([f]) for f in files] == lean
    assert "description" in json.dumps(schema.load_crds().lookup("kubeflow.org/v1", "PyTorchJob")["schema"]["properties"])
