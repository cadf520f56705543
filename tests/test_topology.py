"""One topology everywhere: for any job, every target and flavor starts the same nodes x
processes, the same world size, and ranks 0..N-1 each exactly once.

The chain is the real one end to end, minus the cluster: the rendered objects; what the
flavor's controller makes of them (`deploy/k8s/<flavor>/operator.py`, the pods and their final
env, as `run --docker` runs them); the env the kubelet gives each container; then
`trainer.launch.plan.plan_launch` on that env, which is what each pod runs. For Slurm: the rendered
sbatch script's #SBATCH lines and its own export lines run by real bash in each task's Slurm
environment, then `plan_launch`. The Kubernetes and Slurm testbeds run the same jobs for real.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deploy.errors import UserError
from deploy.k8s import FLAVORS, flavor
from deploy.k8s.render import render_objects
from deploy.run import docker
from deploy.slurm.render import render_slurm
from tests.builders import make_job
from trainer.launch.plan import plan_launch

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
topologies = st.tuples(st.integers(1, 4), st.sampled_from([0, 1, 2, 8]), st.integers(1, 3))


def build(nodes: int, gpus: int, procs: int, **fields):
    shape = {"gpus_per_node": gpus} if gpus else {"procs_per_node": procs}
    try:
        return make_job(nodes=nodes, **shape, **fields)
    except UserError:
        assume(False)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("flavor_name", FLAVORS)
@SETTINGS
@given(topology=topologies)
def test_every_flavor_starts_ranks_0_to_n_once_with_the_job_s_world_size(flavor_name, topology):
    job = build(*topology)
    objects = render_objects(job, flavor=flavor_name)
    pods = docker.controller_pods(objects)
    assert len(pods) == job.nodes.min
    container = flavor(flavor_name).CONTAINER
    ranks, endpoints = [], set()
    for pod in pods:
        (main,) = [c for c in pod.spec["containers"] if c["name"] == container]
        env = {**docker.resolve_env(pod, main, objects, {}), "HOSTNAME": pod.hostname}
        plan = plan_launch(env)
        assert plan.mode == "torchrun"
        assert flag(plan.argv, "--nnodes") == str(job.nodes.min)
        assert int(flag(plan.argv, "--nproc-per-node")) == job.nproc_per_node
        assert plan.node_rank == pod.index
        ranks.append(plan.node_rank)
        endpoints.add(flag(plan.argv, "--rdzv-endpoint"))
    assert sorted(ranks) == list(range(job.nodes.min))
    (endpoint,) = endpoints  # every node meets at one place: node 0's stable name
    host = endpoint.rpartition(":")[0]
    assert host in pods[0].dns_names or host == pods[0].hostname
    assert job.nodes.min * job.nproc_per_node == job.world_size


def sbatch_option(script: str, name: str) -> str:
    return re.search(rf"^#SBATCH --{name}=(\S+)$", script, re.M).group(1)


def task_env(script: str, slurm: dict[str, str]) -> dict[str, str]:
    """The script's own `export DDPKIT_*=` lines and its port line, run by bash in `slurm`."""
    lines = [line for line in script.splitlines()
             if re.match(r"^(export )?DDPKIT_[A-Z_]+=", line) and "scontrol" not in line
             and not line.startswith("DDPKIT_JOB_FILE")]
    out = subprocess.run(["bash", "-c", "set -eu\n" + "\n".join(lines) + "\nexport DDPKIT_MASTER_PORT\nenv -0"],
                         env=slurm, capture_output=True, text=True, check=True, timeout=30).stdout
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
@SETTINGS
@given(topology=topologies)
def test_slurm_tasks_form_the_same_world_in_both_modes(launcher, topology):
    job = build(*topology, slurm={"launcher": launcher})
    script = render_slurm(job)
    nodes, per_node = int(sbatch_option(script, "nodes")), int(sbatch_option(script, "ntasks-per-node"))
    assert nodes == job.nodes.min
    assert per_node == (1 if launcher == "torchrun" else job.nproc_per_node)
    ranks = []
    for node in range(nodes):
        for local in range(per_node):
            slurm = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes),
                     "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"n[{1:02d}-{nodes:02d}]" if nodes > 1 else "n01",
                     "SLURM_NODEID": str(node), "SLURM_PROCID": str(node * per_node + local),
                     "SLURM_LOCALID": str(local), "SLURM_NTASKS": str(nodes * per_node),
                     "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})"}
            plan = plan_launch(task_env(script, slurm))
            if launcher == "torchrun":
                assert plan.mode == "torchrun" and plan.node_rank == node
                assert flag(plan.argv, "--nnodes") == str(nodes)
                assert int(flag(plan.argv, "--nproc-per-node")) == job.nproc_per_node
                assert flag(plan.argv, "--rdzv-endpoint") == "n01:19242"
                ranks.append(node)
            else:
                assert plan.mode == "srun"
                assert int(plan.env["WORLD_SIZE"]) == job.world_size
                assert int(plan.env["LOCAL_RANK"]) == local
                assert (plan.env["MASTER_ADDR"], plan.env["MASTER_PORT"]) == ("n01", "19242")
                ranks.append(int(plan.env["RANK"]))
    world = nodes if launcher == "torchrun" else job.world_size
    assert sorted(ranks) == list(range(world))
