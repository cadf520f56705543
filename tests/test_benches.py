"""The GPU script can never rot: `bench/gpu.sh --cpu-check` runs its every Python part, shrunk,
on CPU (bash -n and shellcheck of the script itself first), as the GPU machine would run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_gpu_sh_cpu_check_runs_every_gpu_bench_on_cpu(tmp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHON": sys.executable, "DDPKIT_BENCH_RESULTS": str(tmp_path)}
    result = subprocess.run(["bash", "bench/gpu.sh", "--cpu-check"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "CPU dry check passed" in result.stdout
    written = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(written) >= {"gpu_path_cpu_check.json", "gpu_cpu_check.json", "dp_vs_ddp_cpu_check.json"}
    path = written["gpu_path_cpu_check.json"]
    assert not path.get("notes") or not any("failed" in n for n in path["notes"]), path.get("notes")
    restart = next(t for t in path["tables"] if t["caption"].startswith("a worker killed"))
    for row in restart["rows"]:  # restarted once, warm, and on CPU bit for bit with the straight run
        assert row[1] == 1 and row[4] == "yes" and row[5] == "yes", row
