"""Right-sized ranks on real nodes: CPU threads per rank from what each target gives a rank.

Table tests with the environment of each target (as tests/test_launch.py does for contexts),
then a real launch. The GPU decisions are in tests/test_workloads.py (functions; no GPU here).
"""

from __future__ import annotations

import pytest

from tests.trainer_util import run, summary, write_job
from trainer.launch.node import cgroup_cpus
from trainer.launch.plan import CPUs, plan_launch, threads_per_rank
from trainer.train import torch_threads as trainer_threads

SLURM = {"SLURM_JOB_ID": "42", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu01",
         "DDPKIT_NPROC_PER_NODE": "8"}
SRUN = {**SLURM, "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "8",
        "DDPKIT_LAUNCHER": "srun"}
PYTORCHJOB = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "j-master-0",
              "PET_MASTER_PORT": "23456", "RANK": "0", "DDPKIT_NPROC_PER_NODE": "8"}

# target, env, CPUs (affinity, cgroup quota, resources.cpus_per_node, train.threads), expected, why
CASES = [
    # srun, one task per GPU on a 64-CPU 8-GPU node with --cpus-per-task=8: the task's own 8 CPUs
    # (the old rule divided them again by the 8 local ranks: 1 thread)
    ("slurm-srun", {**SRUN, "SLURM_CPUS_PER_TASK": "8"}, CPUs(8), "8", "affinity"),
    # srun without task binding (task/none): affinity is the node, --cpus-per-task bounds it
    ("slurm-srun-unbound", {**SRUN, "SLURM_CPUS_PER_TASK": "8"}, CPUs(64), "8", "SLURM_CPUS_PER_TASK"),
    # torchrun per node: the one task holds the node's CPUs, shared by its 8 ranks
    ("slurm-torchrun", {**SLURM, "SLURM_CPUS_PER_TASK": "64"}, CPUs(64), "8", "affinity"),
    # a pod sees the whole host (96 CPUs) but asked for 16: 2 per rank
    ("pytorchjob", PYTORCHJOB, CPUs(96, cgroup=16.0, job=16.0), "2", "cgroup CPU quota"),
    ("pytorchjob-no-quota", PYTORCHJOB, CPUs(96, job=16.0), "2", "resources.cpus_per_node"),
    ("indexed-job-cgroup-only", {"JOB_COMPLETION_INDEX": "0", "DDPKIT_NNODES": "2", "DDPKIT_NPROC_PER_NODE": "4",
                                 "DDPKIT_MASTER_ADDR": "m", "DDPKIT_MASTER_PORT": "29500"},
     CPUs(96, cgroup=6.0), "1", "cgroup CPU quota"),
    ("local", {"DDPKIT_NPROC_PER_NODE": "2"}, CPUs(8), "4", "affinity"),
    ("local-more-ranks-than-cpus", {"DDPKIT_NPROC_PER_NODE": "4"}, CPUs(2), "1", "affinity"),
]


@pytest.mark.parametrize("target, env, cpus, threads, source", CASES, ids=[c[0] for c in CASES])
def test_threads_per_rank_for_each_target(target, env, cpus, threads, source):
    plan = plan_launch(env, python="/py", cpus=cpus)
    assert plan.env["OMP_NUM_THREADS"] == threads
    assert f"threads per rank: {threads} per rank (from {source})" in plan.notes


def test_train_threads_wins_then_the_users_omp_num_threads_in_launcher_and_worker_alike():
    env = {"DDPKIT_NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "3"}
    plan = plan_launch(env, python="/py", cpus=CPUs(64, threads=5))
    assert plan.env["OMP_NUM_THREADS"] == "5"
    assert plan_launch(env, python="/py", cpus=CPUs(64)).env["OMP_NUM_THREADS"] == "3"
    assert threads_per_rank({}, CPUs(64, job=4.0, threads=5), 2, False) == ("5", "5 (train.threads)")
    assert trainer_threads(None, {"OMP_NUM_THREADS": "3"}, 8) == 3
    assert trainer_threads(7, {"OMP_NUM_THREADS": "3"}, 8) == 7


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "250000 100000\n"}, 2.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cgroup_cpu_quota_is_read_v2_and_v1(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpus(str(tmp_path)) == expected


@pytest.mark.slow
def test_a_launched_rank_uses_the_cpus_the_job_asked_for(tmp_path):
    job = write_job(tmp_path, "cpus", {"max_steps": 2, "data_samples": 256, "threads": None})
    job.write_text(job.read_text() + "resources: {cpus_per_node: 1}\n")
    result = run(job, tmp_path, nproc=1, OMP_NUM_THREADS="")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "threads per rank: 1 per rank (from resources.cpus_per_node)" in result.stdout
    assert summary(tmp_path / "runs" / "cpus")["threads_per_rank"] == 1
