"""Your own script's progress with no change to it (trainer/script_steps.py): real launchers,
real gloo process groups, the script knows nothing of ddpkit; `ddpkit status` and `why` read
the same records as for the built-in trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ddpkit
from tests.trainer_util import launch_env, wait_for

pytestmark = pytest.mark.slow

# A textbook DDP loop (SLOW_RANK: that rank is 30 ms slower a step); with GAN=1 a second optimizer steps after the first, every iteration.
SCRIPT = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
for i in range(int(os.environ["ITERATIONS"])):
    if dist.get_rank() == int(os.environ.get("SLOW_RANK", "-1")):
        time.sleep(0.03)  # its own work: the other rank waits for it in DDP's all-reduce
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    if os.environ.get("GAN"):
        other.step()
    time.sleep(float(os.environ.get("PAUSE", "0")))
dist.destroy_process_group()
"""


def script_job(tmp: Path, name: str, **top) -> Path:
    (tmp / "train.py").write_text(SCRIPT)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "script": "train.py", **top}))
    return path


def launch(job: Path, tmp: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=tmp, env=launch_env(job, 2, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def status(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return ddpkit("status", str(run_dir), *extra)


def test_a_running_script_shows_its_steps_and_eta_then_completes(tmp_path):
    job = script_job(tmp_path, "steps", steps=60)
    proc = launch(job, tmp_path, ITERATIONS="60", PAUSE="0.1")
    run_dir = tmp_path / "runs" / "steps"
    try:
        def mid_run() -> dict | None:
            result = status(run_dir, "--json")
            record = json.loads(result.stdout)["progress"] if result.returncode == 0 else None
            return record if record and 5 <= record["step"] < 60 and record["state"] == "running" else None

        wait_for(mid_run, 180, "a progress record mid-run")
        line = status(run_dir).stdout
        assert line.startswith("RUNNING  step ") and "/60 (" in line and "steps/s" in line and "ETA " in line, line
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert status(run_dir).stdout.startswith("SUCCEEDED  step 60/60 (100%)")
    why = ddpkit("why", str(run_dir)).stdout.splitlines()
    assert why[0] == "completed: attempt 0: step 60/60", why


def test_each_step_is_counted_once_with_a_second_optimizer_and_without_a_total(tmp_path):
    """A GAN's second optimizer (or a second optimizer of one step) is not another step; no
    `steps:` in the job file: the step and the rate, no total, no ETA."""
    job = script_job(tmp_path, "gan")
    proc = launch(job, tmp_path, ITERATIONS="25", GAN="1")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    record = json.loads(status(tmp_path / "runs" / "gan", "--json").stdout)["progress"]
    assert (record["step"], record["total_steps"], record["eta_s"]) == (25, None, None), record
    assert status(tmp_path / "runs" / "gan").stdout.startswith("SUCCEEDED  step 25  ")


def test_steps_belong_to_a_script():
    from deploy.errors import UserError
    from deploy.load import parse_job

    with pytest.raises(UserError, match="steps: counts the steps of your script or module"):
        parse_job({"name": "s", "image": "img:1", "steps": 10})
    assert parse_job({"name": "s", "image": "img:1", "script": "t.py", "steps": 10}).steps == 10


def test_a_rank_slower_at_its_own_work_is_named_the_straggler(tmp_path):
    """Rank 1 spends 30 ms more a step before its forward pass; DDP makes both ranks' steps
    equally long, and the gradient hooks still tell the slow one: `status` names it, rank 0's
    stderr says so, and the per-rank times show rank 0 waiting."""
    job = script_job(tmp_path, "slow", train={"log_every_steps": 4})
    proc = launch(job, tmp_path, ITERATIONS="200", SLOW_RANK="1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "ddpkit straggler: rank 1 on " in out, out[-3000:]
    record = json.loads(status(tmp_path / "runs" / "slow", "--json").stdout)["progress"]
    assert record["straggler"]["rank"] == 1 and record["straggler"]["slower"] > 1.5, record
    assert "straggler: rank 1 on " in status(tmp_path / "runs" / "slow").stdout
    own = {r["rank"]: r for r in record["ranks"]}
    assert own[1]["own_s"] > 0.025 > own[0]["own_s"] and own[0]["wait_s"] > 0.025, record["ranks"]


def test_ranks_alike_name_no_straggler(tmp_path):
    """The same loop with no slow rank: windows compared, nobody named."""
    job = script_job(tmp_path, "even", train={"log_every_steps": 4})
    proc = launch(job, tmp_path, ITERATIONS="120", PAUSE="0.03")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "ddpkit straggler" not in out, out[-3000:]
    record = json.loads(status(tmp_path / "runs" / "even", "--json").stdout)["progress"]
    assert record["straggler"] is None and len(record["ranks"]) == 2, record
