"""A non-editable install (a real wheel) carries the sbatch templates and renders outside the repo."""

from __future__ import annotations

import os
import re
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
    # the templates, exactly: no CI-only scripts (k8s/testbed, k8s/kind) in a user's install
    shipped = sorted(n.removeprefix("deploy/_templates/") for n in names
                     if n.startswith("deploy/_templates/"))
    assert shipped == sorted(p.relative_to(REPO).as_posix() for p in (REPO / "slurm").rglob("*.j2"))
    assert any(n.startswith("slurm/") for n in shipped)
    assert not any(n.startswith("k8s/") for n in shipped)  # Kubernetes objects are data
    assert any(n.startswith("deploy/k8s/") for n in names)
    assert not any("testbed/build.sh" in n or "kind/" in n for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "Requires-Python: >=3.11" in metadata


def test_the_wheel_imports_as_ddpkit_and_is_typed(installed, tmp_path):
    """`import ddpkit` from the installed wheel (not the checkout): the Python API renders."""
    wheel, target = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddpkit.py" in names and "deploy/py.typed" in names and "trainer/py.typed" in names
    probe = ("import ddpkit, deploy\n"
             f"assert deploy.__file__.startswith({str(target)!r}), deploy.__file__\n"
             "job = ddpkit.Job(name='w', image='img:1', checkpoint={'ephemeral': True})\n"
             "print(sorted(ddpkit.__all__), [o['kind'] for o in job.request('k8s', flavor='job')])\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("] ")[1].strip() == "['ConfigMap', 'Service', 'Job']"


def test_every_dependency_is_imported_and_the_python_claim_is_one():
    """A runtime dependency nothing imports only weighs on `pip install`; the Python version
    claim (tomllib in the tests and the image need 3.11) is the same everywhere."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    import_name = {"pyyaml": "yaml", "python-hostlist": "hostlist", "kubernetes-validate":
                   "kubernetes_validate", "common-expression-language": "cel",
                   "prometheus-client": "prometheus_client"}
    commands = {"py-spy"}  # installed for its command, not imported (trainer/watchdog.py runs it)
    sources = "\n".join(p.read_text() for d in ("deploy", "trainer") for p in (REPO / d).rglob("*.py"))
    extras = project["project"]["optional-dependencies"]
    for requirement in project["project"]["dependencies"] + extras["train"] + extras["k8s"] + extras["slurm"]:
        name = re.split(r"[<>=!~\[ ]", requirement)[0].lower()
        if name in commands:
            assert f'"{name}"' in sources, f"{name}'s command is never run"
            continue
        module = import_name.get(name, name)
        assert re.search(rf"^\s*(import|from) {module}\b", sources, re.M), f"{name} is never imported"
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
    readme = (REPO / "README.md").read_text()
    assert "Python 3.11+" in readme and "3.10" not in readme


def test_installed_copy_is_used_outside_the_repo(installed, tmp_path):
    _, target = installed
    probe = "import deploy.slurm.template as r; print(r.template_dir('slurm'))"
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


def test_installed_lint_uses_the_bundled_crds(installed, tmp_path):
    """`ddpkit lint` of a rendered PyTorchJob works from the wheel alone (CRDs ship inside it)."""
    wheel, target = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "deploy/lint/crds/kubeflow.org_pytorchjobs.yaml" in names
    assert "deploy/lint/crds/clustertrainingruntime-torch-distributed.yaml" in names
    assert run_installed(target, "init", "job.yaml", cwd=tmp_path).returncode == 0
    for flavor in ("pytorchjob", "trainjob"):
        rendered = run_installed(target, "render", "k8s", "job.yaml", "--flavor", flavor, cwd=tmp_path)
        (tmp_path / f"{flavor}.yaml").write_text(rendered.stdout)
        env = {**os.environ, "PYTHONPATH": str(target), "XDG_CACHE_HOME": str(tmp_path / "cache")}
        result = subprocess.run([sys.executable, "-m", "deploy", "lint", f"{flavor}.yaml"], cwd=tmp_path,
                                env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
