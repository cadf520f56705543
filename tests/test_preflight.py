"""`python -m trainer.preflight` and `preflight: true`: real processes, one failure per way.

Every case starts the real launcher (or a user's torchrun) on this machine: the verdict lines
and exit codes are what a node prints.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.trainer_util import REPO, free_port, launch_env, run, summary, write_job

pytestmark = pytest.mark.slow


def preflight(job, cwd, timeout: float = 180, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.preflight"], cwd=cwd, env=launch_env(job, **extra),
                          capture_output=True, text=True, timeout=timeout)


def test_preflight_true_checks_every_node_then_trains(tmp_path):
    job = write_job(tmp_path, "pf", {"max_steps": 3})
    doc = yaml.safe_load(job.read_text())
    job.write_text(yaml.safe_dump({**doc, "preflight": True}))
    result = run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("ddpkit preflight: node")]
    assert len(verdicts) == 1, result.stdout[-3000:]  # one node, one line (not one per rank)
    line = verdicts[0]
    assert ": OK: store " in line and "world 2 on 1 host(s), ranks 0-1 here" in line
    assert "gloo on cpu" in line and "gloo TCP" in line
    bw = float(line.split(" GB/s bus bandwidth")[0].rsplit(" ", 1)[1])
    assert bw > 0
    assert summary(tmp_path / "runs" / "pf")["steps"] == 3  # ... and then trained in the same processes


@pytest.mark.parametrize("addr, why", [
    ("no-such-host.invalid", "host 'no-such-host.invalid' does not resolve (DNS)"),
    ("127.0.0.1", "closed on 127.0.0.1 (nothing listens)"),
])
def test_a_master_that_never_comes_up_stops_the_node_after_the_wait_naming_it(tmp_path, addr, why):
    """Node 1 of 2 waits train.timeout_s for the master, then exits 1 with host:port and why."""
    job = write_job(tmp_path, "nomaster", {"timeout_s": 10})
    port = free_port()
    result = preflight(job, tmp_path, JOB_COMPLETION_INDEX="1", DDPKIT_NNODES="2", DDPKIT_MASTER_ADDR=addr,
                       DDPKIT_MASTER_PORT=str(port))
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"master {addr}:{port} not reachable after 10s: " in last and why in last, last
    assert "Traceback" not in result.stderr


def test_preflight_names_a_world_size_the_job_did_not_ask_for(tmp_path):
    """A user's own torchrun starts 2 workers where the launch contract says 1 node x 3."""
    job = write_job(tmp_path, "mismatch")
    env = {**launch_env(job), "DDPKIT_NNODES": "1", "DDPKIT_NPROC_PER_NODE": "3"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "trainer.preflight"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    failed = [line for line in result.stderr.splitlines() if line.startswith("ddpkit preflight:") and "FAILED" in line]
    assert failed, result.stderr[-3000:]  # (torchrun may stop the other rank before it prints)
    assert "world size 2, but the job asks for 3 (1 node(s) x 3 processes)" in failed[0]


def test_preflight_names_a_backend_the_device_cannot_run(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: train.device cuda is right here")
    job = write_job(tmp_path, "nogpu", {"device": "cuda"})
    result = preflight(job, tmp_path)
    assert result.returncode != 0
    failed = [line for line in result.stderr.splitlines() if "FAILED" in line]
    assert failed and "train.device is cuda but no CUDA device is visible" in failed[0], \
        result.stderr[-3000:]


def test_ddpkit_validate_knows_the_preflight_field(tmp_path):
    from tests.conftest import ddpkit

    job = tmp_path / "j.yaml"
    job.write_text("name: pfv\nimage: ddpkit:0.1\npreflight: true\n")
    assert ddpkit("validate", str(job)).returncode == 0
    job.write_text("name: pfv\nimage: ddpkit:0.1\npreflight: maybe\n")
    bad = ddpkit("validate", str(job))
    assert bad.returncode == 2 and "preflight" in bad.stderr
    assert REPO.exists()
