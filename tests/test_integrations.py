"""The planned steps of your own script from its framework (trainer/integrations.py), real runs:
Lightning through its callbacks entry point, Hugging Face `Trainer` through the guard's import
hook, a plain loop through `set_total_steps`; none of the job files gives `steps:`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, ddpkit

pytestmark = pytest.mark.slow

PLAIN = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from trainer.integrations import set_total_steps

dist.init_process_group("gloo")
set_total_steps(7)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(7):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
dist.destroy_process_group()
"""


def need(module: str) -> None:
    """Skip where the framework is not installed; in CI it must be (`make test` installs it)."""
    if os.environ.get("CI") == "true":
        __import__(module)
    else:
        pytest.importorskip(module)


@pytest.mark.parametrize("script,module", [("lightning_fit.py", "pytorch_lightning"),
                                           ("hf_trainer.py", "transformers"), ("plain.py", None)])
def test_a_frameworks_planned_steps_reach_status_with_no_steps_field(tmp_path, script, module):
    if module:
        need(module)
        shutil.copy(REPO / "tests" / "frameworks" / script, tmp_path / script)
    else:
        (tmp_path / script).write_text(PLAIN)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "planned", "image": "img:1", "procs_per_node": 2, "script": script}))
    result = ddpkit("run", str(job), "--local", cwd=tmp_path, timeout=300,
                    env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "STEPS": "12"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = ddpkit("status", str(tmp_path / "runs" / "planned"), "--json", cwd=tmp_path)
    progress = json.loads(status.stdout)["progress"]
    want = 7 if module is None else 12
    assert (progress["state"], progress["step"], progress["total_steps"]) == ("completed", want, want), progress


def test_lightning_beside_a_trainer_package_of_its_own_is_left_alone(tmp_path):
    """The entry point ddpkit declares must not break a Lightning program that has its own
    top-level `trainer` package (a common name) when ddpkit does not run it."""
    need("pytorch_lightning")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("")
    shutil.copy(REPO / "tests" / "frameworks" / "lightning_fit.py", tmp_path / "fit.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_")}
    proc = subprocess.run([sys.executable, "fit.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**env, "STEPS": "3", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "params sha256" in proc.stdout
