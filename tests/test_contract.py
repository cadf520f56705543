"""trainer.contract: the launch contract as one type, and the launcher's topology per context."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import contract
from trainer.contract import LaunchEnv, slurm_port, slurm_port_bash, var
from trainer.launch import plan
from trainer.launch.plan import CONTEXTS, detect_context, plan_launch

FIELDS = dataclasses.fields(LaunchEnv)
INT_FIELDS = [f.name for f in FIELDS if f.type == "int | None"]
# A value as an environment carries it: not empty (empty means unset), no NUL.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1)


def launch_envs() -> st.SearchStrategy[LaunchEnv]:
    return st.builds(LaunchEnv, **{
        f.name: st.none() | (st.integers() if f.name in INT_FIELDS else TEXT) for f in FIELDS
    })


@settings(max_examples=200, deadline=None)
@given(launch_envs())
def test_to_env_and_from_env_round_trip(le):
    env = le.to_env()
    assert list(env) == [var(f.name) for f in FIELDS if getattr(le, f.name) is not None]  # field order
    assert all(isinstance(v, str) for v in env.values())
    assert LaunchEnv.from_env({**env, "PATH": "/bin", "DDPKIT_OTHER": "x"}) == le


def test_an_empty_variable_is_unset():
    assert LaunchEnv.from_env({var(f.name): "" for f in FIELDS}) == LaunchEnv()


@pytest.mark.parametrize("name", INT_FIELDS)
def test_a_bad_number_names_its_variable(name):
    with pytest.raises(ValueError, match=f"^{var(name)}='2x' is not a number$"):
        LaunchEnv.from_env({var(name): "2x"})


def test_each_field_variable_has_its_name():
    names = {k: v for k, v in vars(contract).items() if k.endswith("_VAR")}
    fields = {f"{f.name.upper()}_VAR": var(f.name) for f in FIELDS}
    assert {k: names[k] for k in fields} == fields
    assert all(v.startswith("DDPKIT_") for v in names.values())
    assert len(set(names.values())) == len(names)  # one name per variable


JOB_IDS = [0, 1, 42, 4242, 9999, 10000, 123456, 2**31 - 1]


def test_slurm_port_is_what_bash_computes():
    script = f"for SLURM_JOB_ID in {' '.join(map(str, JOB_IDS))}; do echo {slurm_port_bash()}; done"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert [int(line) for line in out.split()] == [slurm_port(j) for j in JOB_IDS]
    assert [plan.slurm_port({"SLURM_JOB_ID": str(j)}) for j in JOB_IDS] == [str(slurm_port(j)) for j in JOB_IDS]
    assert all(0 < slurm_port(j) < 65536 for j in JOB_IDS)


def test_the_launcher_uses_the_contracts_exit_codes_and_defaults():
    argv = plan_launch({}, python="/py").argv
    assert argv[argv.index("--shutdown-timeout") + 1] == str(contract.DEFAULT_STOP_GRACE_S)
    assert argv[argv.index("--rdzv-endpoint") + 1] == f"127.0.0.1:{contract.DEFAULT_PORT}"


# -- every context: the plan's topology is the node's ------------------------------------------
# One node of a job of `nodes` nodes x `nproc` processes, as each context's scheduler shows it
# (`local`: the process of that node; `torchrun` and `slurm-srun`: one worker of it).
def _env(ctx: str, nodes: int, nproc: int, node: int, local: int) -> dict[str, str]:
    world, rank = nodes * nproc, node * nproc + local
    hosts = f"n[0-{nodes - 1}]" if nodes > 1 else "n0"
    return {
        "torchrun": {"TORCHELASTIC_RUN_ID": "r", "RANK": str(rank), "WORLD_SIZE": str(world),
                     "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "n0",
                     "MASTER_PORT": "29400"},
        "slurm-srun": {"SLURM_JOB_ID": "77", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
                       "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": hosts,
                       "SLURM_TASKS_PER_NODE": f"{nproc}(x{nodes})", var("launcher"): "srun"},
        "kubeflow-pytorchjob": {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc),
                                "PET_NODE_RANK": str(node), "PET_MASTER_ADDR": "j-master-0",
                                "PET_MASTER_PORT": "23456", "RANK": str(node), "WORLD_SIZE": str(world),
                                "MASTER_ADDR": "j-master-0", "MASTER_PORT": "23456"},
        "kubeflow-elastic": {"PET_RDZV_ENDPOINT": "j-worker-0:23456", "PET_NNODES": f"1:{nodes}",
                             "PET_NPROC_PER_NODE": str(nproc), "HOSTNAME": f"j-worker-{node}"},
        "kubeflow-trainjob": {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc),
                              "PET_NODE_RANK": str(node), "PET_MASTER_ADDR": "j-node-0-0.j",
                              "PET_MASTER_PORT": "29500"},
        "indexed-job": {"JOB_COMPLETION_INDEX": str(node), **LaunchEnv(
            nnodes=str(nodes), nproc_per_node=nproc, master_addr="j-0.j", master_port=29500).to_env()},
        "slurm": {"SLURM_JOB_ID": "77", "SLURM_NODEID": str(node), "SLURM_JOB_NUM_NODES": str(nodes),
                  "SLURM_JOB_NODELIST": hosts, var("nproc_per_node"): str(nproc)},
        "skypilot": {"SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NUM_NODES": str(nodes),
                     "SKYPILOT_NUM_GPUS_PER_NODE": str(nproc),
                     "SKYPILOT_NODE_IPS": " ".join(f"10.0.0.{i}" for i in range(nodes))},
        "local": LaunchEnv(nnodes=str(nodes), nproc_per_node=nproc).to_env(),
    }[ctx]


def test_every_context_has_a_topology_case():
    for ctx in CONTEXTS:
        assert detect_context(_env(ctx.name, 2, 2, 1, 1)).name == ctx.name


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("ctx", [c.name for c in CONTEXTS])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_plan_has_the_nodes_topology_in_every_context(ctx, data):
    nodes = data.draw(st.integers(1, 64), "nodes")
    nproc = data.draw(st.integers(1, 16), "nproc")
    node = 0 if ctx == "local" else data.draw(st.integers(0, nodes - 1), "node rank")
    local = data.draw(st.integers(0, nproc - 1), "local rank")
    env = _env(ctx, nodes, nproc, node, local)
    plan = plan_launch(env, python="/py")
    assert plan.context == ctx
    if plan.mode == "direct":  # already a worker: its variables pass through untouched
        assert plan.env == env
        return
    if plan.mode == "srun":
        out = plan.env
        assert (out["RANK"], out["LOCAL_RANK"]) == (str(node * nproc + local), str(local))
        assert (out["WORLD_SIZE"], out["LOCAL_WORLD_SIZE"]) == (str(nodes * nproc), str(nproc))
        assert plan.node_rank == node
        assert (out["MASTER_ADDR"], out["MASTER_PORT"]) == ("n0", str(slurm_port(77)))
        return
    argv = plan.argv
    assert plan.mode == "torchrun" and argv[1:3] == ["-m", "torch.distributed.run"]
    nnodes, nproc_out = _flag(argv, "--nnodes"), _flag(argv, "--nproc-per-node")
    assert int(nproc_out) == nproc
    if ctx == "kubeflow-elastic":  # c10d assigns the ranks; the endpoint's pod hosts the store
        assert nnodes == f"1:{nodes}"
        assert plan.node_rank == (0 if node == 0 else None)
        assert ("is_host=true" in _flag(argv, "--rdzv-conf")) == (node == 0)
        return
    assert int(nnodes) * int(nproc_out) == nodes * nproc  # the world size
    assert int(nnodes) == nodes and plan.node_rank == node
    assert _flag(argv, "--rdzv-conf").startswith(f"is_host={'true' if node == 0 else 'false'},")
    assert (plan.wait_for is None) == (node == 0)  # the others wait for node 0's port
    assert not any(k.startswith("PET_") or k in ("RANK", "WORLD_SIZE") for k in plan.env)
