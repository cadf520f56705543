"""The Python API (`import ddpkit`, deploy/api.py): the README's example runs, a Job says what
`ddpkit` says, every problem carries its field, and a Handle reads a job's state. The cluster
half of the README runs against the Slurm testbed (tests/test_slurm_e2e.py)."""

from __future__ import annotations

import re
import shutil

import pytest

import ddpkit
from deploy.errors import FieldProblem
from tests.conftest import REPO, cli

EXAMPLE = REPO / "examples" / "quickstart.yaml"


def readme_python_blocks() -> list[str]:
    section = (REPO / "README.md").read_text().split("### Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    code = readme_python_blocks()[0]
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)  # the run directory (runs/quickstart) lands here
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "['name', 'nodes', 'slurm.partion']" in out and "['ConfigMap', 'JobSet']" in out


def test_public_names_are_few_and_stable():
    assert sorted(ddpkit.__all__) == ["FLAVORS", "Handle", "InvalidJob", "Job", "RuntimeFailure", "STATES", "TARGETS"]


@pytest.mark.parametrize("target", ["k8s", "slurm"])
def test_a_job_renders_what_the_cli_renders(target):
    job = ddpkit.Job.from_file(str(EXAMPLE.relative_to(REPO)), {"nodes": 2, "train.lr": 0.05,
                                                                 "checkpoint.ephemeral": True})
    out = cli("render", target, str(EXAMPLE.relative_to(REPO)), "--set", "nodes=2", "--set", "train.lr=0.05",
              "--set", "checkpoint.ephemeral=true")
    assert out.returncode == 0, out.stderr
    assert job.render(target) == out.stdout


def test_overrides_as_a_mapping_or_as_set_assignments_are_the_same():
    a = ddpkit.Job.from_file(EXAMPLE, {"nodes": 3, "env.A": "1.10", "train.epochs": 2})
    b = ddpkit.Job.from_file(EXAMPLE, ["nodes=3", "env.A=1.10", "train.epochs=2"])
    assert a.to_yaml() == b.to_yaml() and a.spec.env["A"] == "1.10"
    with pytest.raises(ddpkit.InvalidJob) as raised:  # located as an override, like --set
        ddpkit.Job.from_file(EXAMPLE, {"nodes": "zero"})
    assert raised.value.problems[0].where == "--set nodes"


def test_every_problem_at_once_each_with_where_and_field():
    with pytest.raises(ddpkit.InvalidJob) as raised:
        ddpkit.Job(name="x", image="i:1", nodes="zero", restarts=-1, slurm={"partion": "p"})
    problems = raised.value.problems
    assert all(isinstance(p, FieldProblem) for p in problems)
    assert sorted(p.field for p in problems) == ["nodes", "restarts", "slurm.partion"]
    assert problems[0] == f"{problems[0].where}: {problems[0].field}: {problems[0].message}"


def test_validate_names_the_field_a_target_cannot_do():
    job = ddpkit.Job(name="el", image="i:1", nodes="2:4", checkpoint={"ephemeral": True})
    assert job.validate("k8s", flavor="pytorchjob") == ["k8s"]
    with pytest.raises(ddpkit.InvalidJob) as raised:
        job.validate("k8s", flavor="jobset")
    assert [p.field for p in raised.value.problems] == ["nodes"]
    with pytest.raises(ddpkit.InvalidJob, match="--flavor applies to --target k8s only"):
        job.validate("slurm", flavor="job")
    with pytest.raises(ddpkit.InvalidJob, match="target 'aws'"):
        job.validate("aws")


def test_a_handle_reads_state_waits_and_reads_the_log(tmp_path, monkeypatch):
    """Against stand-in scontrol/sacct on PATH (the Slurm testbed runs the real ones)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "job.out"
    log.write_text("step 1\nstep 2\n")
    state = tmp_path / "state"
    state.write_text("RUNNING")
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        f"s=$(cat {state}); echo COMPLETED > {state}\n"
        f"echo \"JobId=7 JobName=w JobState=$s Reason=None Restarts=0 StdOut={log}\"\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    handle = ddpkit.Handle("slurm://7")
    assert handle == ddpkit.Handle("slurm://7") and str(handle) == "slurm://7"
    assert handle.status() == "RUNNING"
    assert handle.wait(timeout=10, poll_s=0.05) == "SUCCEEDED"
    assert handle.logs() == "step 1\nstep 2\n"
    with pytest.raises(ddpkit.InvalidJob, match="is not a job handle"):
        ddpkit.Handle("7")
