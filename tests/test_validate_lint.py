"""`ddpkit validate` judges the objects it would render by `ddpkit lint`'s rules (deploy/targets.py):
nothing that lint calls an error, nor a pod the controller will have refused, leaves validate
with exit 0. The real linter is the oracle: each job of a family of bad (and good) job files is
rendered by the renderer alone, linted as a file, and validated; the property is the point.
"""

from __future__ import annotations

import pytest
import yaml

from deploy.errors import UserError
from deploy.k8s import FLAVORS
from deploy.k8s.render import render_k8s
from deploy.lint import command
from deploy.lint.report import ERROR, LintBug
from deploy.load import parse_job
from tests.builders import job_data
from tests.conftest import cli

#: Bad job files (and two good ones), as patches of the base job: what the job model takes but
#: the API server, an operator or a controller may refuse once rendered.
FAMILY = {
    "good": {},
    "good with extras": {"k8s": {"tolerations": [{"key": "gpu", "operator": "Exists"}],
                                 "extra_resources": {"rdma/ib": "1"}}},
    "patched toleration without a key, Equal": {"k8s": {"pod_patch": {"spec": {"tolerations": [
        {"operator": "Equal", "value": "x"}]}}}},
    "patched volume named like ddpkit's": {"k8s": {"pod_patch": {"spec": {"volumes": [
        {"name": "dshm", "hostPath": {"path": "/x"}}]}}}},
    "patched fractional extended resource": {"k8s": {"pod_patch": {"spec": {"containers": [
        {"name": "trainer", "resources": {"limits": {"example.com/dev": "0.5"},
                                          "requests": {"example.com/dev": "0.5"}}}]}}}},
    "patched dnsPolicy": {"k8s": {"pod_patch": {"spec": {"dnsPolicy": "Sometimes"}}}},
    "patched env name": {"k8s": {"pod_patch": {"spec": {"containers": [
        {"name": "trainer", "env": [{"name": "A B", "value": "1"}]}]}}}},
    "patched negative grace": {"k8s": {"pod_patch": {"spec": {"activeDeadlineSeconds": 0}}}},
    "toleration without a key, Equal": {"k8s": {"tolerations": [{"operator": "Equal", "value": "a"}]}},
    "toleration key not a label name": {"k8s": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}},
    "fractional extended resource": {"k8s": {"extra_resources": {"example.com/dev": "0.5"}}},
    "domain-less extended resource": {"k8s": {"extra_resources": {"dev": "1"}}},
    "volume named like ddpkit's": {"volumes": [{"name": "dshm", "mount": "/x", "empty_dir": {}}]},
}


def lint_says(path) -> tuple[bool, bool]:
    """(an error, a warning that the controller's pods or Services will be refused) in the
    real `ddpkit lint` of the file."""
    found = command.lint_files([str(path)])
    return (any(p.severity == ERROR for p in found),
            any(p.rule in command.REFUSED_LATER for p in found))


def outcome(tmp_path, name: str, flavor: str) -> tuple[str, bool | None, int, str]:
    """What the model says ("model": refused already), what lint says of the renderer's own
    objects, and what `ddpkit validate --flavor` answers."""
    data = job_data(**FAMILY[name])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    validated = cli("validate", str(path), "--flavor", flavor)
    try:
        job = parse_job(data)
        rendered = render_k8s(job, flavor=flavor)  # the renderer alone: no lint pass
    except UserError:
        return "model", None, validated.returncode, validated.stderr
    (tmp_path / "objects.yaml").write_text(rendered)
    error, refused_later = lint_says(tmp_path / "objects.yaml")
    return "rendered", error or refused_later, validated.returncode, validated.stderr


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("name", FAMILY)
def test_validate_refuses_whatever_lint_refuses_of_the_rendered_objects(tmp_path, name, flavor):
    stage, refused, code, err = outcome(tmp_path, name, flavor)
    if stage == "model" or refused:
        assert code == 2, f"lint refuses the rendered {flavor} objects, validate said ok"
        assert err.startswith("error: ") and "Traceback" not in err, err
        assert all(line.startswith(f"error: {tmp_path}") for line in err.splitlines()), err
    else:
        assert code == 0, f"lint accepts the rendered {flavor} objects, validate refused: {err}"


def test_the_family_has_jobs_only_lint_refuses_and_jobs_it_accepts(tmp_path):
    """The property above is exercised: some jobs pass the model and are refused by lint only,
    some pass everything (else the test could not fail)."""
    seen = {outcome(tmp_path, name, "pytorchjob")[:2] for name in FAMILY}
    assert ("rendered", True) in seen and ("rendered", False) in seen


def test_a_lint_refusal_names_the_job_field_behind_it(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_data(k8s={"pod_patch": {"spec": {"dnsPolicy": "Sometimes"}}}),
                                   sort_keys=False))
    for verb in (("validate", str(path)), ("render", "k8s", str(path), "-o", str(tmp_path / "out"))):
        result = cli(*verb, "--flavor", "job")
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith(f"error: {path}:") and \
            ": k8s.pod_patch.spec.dnsPolicy: Unsupported value: \"Sometimes\"" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_crash_of_a_lint_rule_is_ddpkit_s_bug_not_bad_input(tmp_path, monkeypatch):
    from deploy.kube import core

    def crash(*_):
        raise KeyError("boom")

    monkeypatch.setattr(core, "validate_core", crash)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_data(), sort_keys=False))
    with pytest.raises(LintBug, match="a ddpkit lint rule crashed"):
        cli("validate", str(path), "--flavor", "job")


# The job model refuses these classes itself, at the field, with the API server's words (the
# rules are lint's: deploy/kube/core.py), before anything is rendered.

def model_refusal(patch: dict) -> list[str]:
    with pytest.raises(UserError) as info:
        parse_job(job_data(**patch))
    return [f"{p.field}: {p.message}" for p in info.value.problems]


@pytest.mark.parametrize("toleration,field,message", [
    ({"operator": "Equal", "value": "a"}, "operator", "operator must be Exists when `key` is empty"),
    ({"value": "a"}, "operator", "operator must be Exists when `key` is empty"),
    ({"key": "bad key!", "operator": "Exists"}, "key", "name part must consist of alphanumeric"),
    ({"key": "Example.com/x"}, "key", "prefix part a lowercase RFC 1123 subdomain"),
    ({"key": "a", "operator": "Exists", "value": "v"}, "operator", "value must be empty when `operator` is 'Exists'"),
    ({"key": "a", "value": "not a label value"}, "operator", "a valid label must be"),
    ({"key": "a", "effect": "NoSchedule", "toleration_seconds": 5}, "effect", "effect must be 'NoExecute'"),
])
def test_tolerations_are_refused_as_the_api_server_refuses_them(toleration, field, message):
    (line,) = model_refusal({"k8s": {"tolerations": [toleration]}})
    assert line.startswith(f"k8s.tolerations.0.{field}: Invalid value: ") and message in line, line


@pytest.mark.parametrize("name,amount,message", [
    ("example.com/dev", "0.5", 'Invalid value: "0.5": must be an integer'),
    ("example.com/dev", "1.5", 'Invalid value: "1.5": must be an integer'),
    ("dev", "1", 'Invalid value: "dev": must be a standard resource for containers'),
    ("example.com/a b", "1", "name part must consist of alphanumeric characters"),
])
def test_extended_resources_are_whole_numbers_of_a_domain_qualified_name(name, amount, message):
    lines = model_refusal({"k8s": {"extra_resources": {name: amount}}})
    assert any(line.startswith(f"k8s.extra_resources.{name}: ") and message in line for line in lines), lines


@pytest.mark.parametrize("accepted", [{"rdma/ib": "1"}, {"hugepages-2Mi": "1Gi"}, {"ephemeral-storage": "1.5Gi"},
                                      {"kubernetes.io/batteries": "0.5"}])
def test_native_and_whole_extended_resources_are_accepted(accepted):
    job = parse_job(job_data(resources={"memory": "1Gi"}, k8s={"extra_resources": accepted}))
    objects = [o for o in job_objects(job) if o["kind"] == "Job"]
    assert not [p for o in objects for p in command.lint_object(o) if p.severity == ERROR]


def job_objects(job):
    from deploy.k8s.render import render_objects

    return render_objects(job, flavor="job")


@pytest.mark.parametrize("name", ["dshm", "ddpkit-job"])
def test_a_volume_named_like_one_of_ddpkit_s_own_is_refused(name):
    (line,) = model_refusal({"volumes": [{"name": name, "mount": "/x", "empty_dir": {}}]})
    assert line.startswith(f"volumes.0.name: {name} is the name of ddpkit's own volume"), line
