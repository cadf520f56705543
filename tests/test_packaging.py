"""A non-editable install (a real wheel) carries the templates and renders outside the repo."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the wheel and install it (without dependencies: the test venv has them) elsewhere."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(REPO)], check=True, capture_output=True)
    wheel = next(out.glob("ddpkit-*.whl"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    return wheel, target


def run_installed(target, *args, cwd):
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run([sys.executable, "-m", "deploy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_wheel_ships_templates_and_packages(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "deploy/spec.py" in names and "trainer/config.py" in names
    assert "deploy/starter.yaml" in names
    assert any(n.startswith("deploy/_templates/k8s/") for n in names)
    assert any(n.startswith("deploy/_templates/slurm/") for n in names)


def test_installed_copy_is_used_outside_the_repo(installed, tmp_path):
    _, target = installed
    probe = "import deploy.render as r; print(r.template_dir('slurm'))"
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.stdout.strip().startswith(str(target)), result.stdout + result.stderr


def test_installed_init_and_validate(installed, tmp_path):
    _, target = installed
    assert run_installed(target, "init", "job.yaml", cwd=tmp_path).returncode == 0
    result = run_installed(target, "validate", "job.yaml", cwd=tmp_path)
    assert result.returncode == 0 and "ok: my-ddp-job" in result.stdout


@pytest.mark.parametrize("flavor", ["pytorchjob", "trainjob", "jobset", "job"])
def test_installed_renders_every_k8s_flavor(installed, tmp_path, flavor):
    import yaml

    _, target = installed
    assert run_installed(target, "init", "job.yaml", cwd=tmp_path).returncode == 0
    result = run_installed(target, "render", "k8s", "job.yaml", "--flavor", flavor, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert kinds[0] == "ConfigMap" and len(kinds) >= 2
