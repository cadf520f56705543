"""The registry every command goes through (deploy/targets.py): each target's `request` is
what its `render` lays out, and the errors for a wrong option or handle are one line."""

from __future__ import annotations

import re

import pytest

from deploy.errors import UserError
from deploy.k8s.render import parse_objects
from deploy.slurm.directives import flag
from deploy.targets import REGISTRY, TARGETS, of_handle, refuse_option
from tests.builders import make_job

JOB = make_job(nodes=2, procs_per_node=2, time_limit="1h")


@pytest.mark.parametrize("flavor", ["pytorchjob", "trainjob", "jobset", "job"])
def test_k8s_render_is_its_request_as_yaml(flavor):
    target = REGISTRY["k8s"]
    assert parse_objects(target.render(JOB, flavor=flavor, source="job.yaml")) == target.request(JOB, flavor=flavor)


def test_slurm_render_lays_out_its_request():
    target = REGISTRY["slurm"]
    script = target.render(JOB, source="job.yaml")
    request = target.request(JOB)
    sbatch = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch == [flag(name, value) for name, value in request.directives]
    for name in request.launch_env.to_env():
        assert re.search(rf"^export {name}=", script, re.M), name


def test_every_target_refuses_what_it_cannot_do_before_rendering():
    job = make_job(nodes="2:4")  # elastic: PyTorchJob only
    assert REGISTRY["k8s"].check(job, "jobset") and not REGISTRY["k8s"].check(job, "pytorchjob")
    with pytest.raises(UserError):
        REGISTRY["k8s"].request(job, flavor="jobset")


@pytest.mark.parametrize(("target", "verb", "option", "expected"), [
    ("slurm", "render", {"flavor": "job"}, "--flavor applies to `render k8s` only"),
    ("slurm", "submit", {"flavor": "job"}, "--flavor applies to `submit k8s` only"),
    ("k8s", "submit", {"via": "submitit"}, "--via applies to `submit slurm` only"),
])
def test_an_option_of_another_target_names_its_command(target, verb, option, expected):
    with pytest.raises(UserError) as raised:
        refuse_option(target, verb, **option)
    assert raised.value.problems == [expected]
    refuse_option(next(t for t in TARGETS if t != target), verb, **option)  # its own target takes it


def test_a_handle_picks_its_target_and_anything_else_is_one_line():
    assert of_handle("k8s://ml/job/demo").name == "k8s" and of_handle("slurm://12").name == "slurm"
    with pytest.raises(UserError, match="is not a job handle"):
        of_handle("1234")
