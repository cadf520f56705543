"""`train.bind_cpus` (trainer/host.py): the kernel's per-thread CPU lists are the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_right_sizing import SRUN
from tests.trainer_util import REPO, free_port
from trainer.contract import NODE_CPUS_VAR, format_cpus, parse_cpus
from trainer.host import bind_local_rank, shares
from trainer.launch.plan import CPUs, plan_launch

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity: Linux")


@pytest.mark.parametrize(("cpus", "text"), [
    ([0], "0"), ([0, 1, 2, 3], "0-3"), ([0, 2, 3, 4, 9], "0,2-4,9"), ([5, 1, 0], "0-1,5"),
])
def test_cpu_lists_use_the_kernels_format(cpus, text):
    assert format_cpus(cpus) == text and parse_cpus(text) == sorted(cpus)


def test_shares_are_equal_contiguous_and_disjoint():
    # sysfs of this machine orders them; without siblings, by id
    got = shares(range(7), 3)
    assert [len(s) for s in got] == [2, 2, 2]
    assert len({c for s in got for c in s}) == 6  # one CPU left over, unused by the ranks


@pytest.mark.parametrize(("env", "local_world", "threads", "workers", "why"), [
    ({}, 2, 1, 0, "not started by ddpkit's per-node launcher"),
    ({NODE_CPUS_VAR: "0-1"}, 1, 1, 0, "one rank on this node"),
    ({NODE_CPUS_VAR: "0-1"}, 2, 1, 2, "train.num_workers 2"),
])
def test_a_rank_is_left_to_the_scheduler_when_binding_would_not_fit(env, local_world, threads, workers, why):
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    note = bind_local_rank(env, 0, local_world, threads, workers)
    assert note.startswith("CPUs left to the scheduler") and why in note, note
    if before is not None:
        assert os.sched_getaffinity(0) == before


@linux
def test_a_share_smaller_than_the_ranks_threads_or_a_worker_bound_elsewhere_is_left_alone():
    node = format_cpus(os.sched_getaffinity(0))
    n = len(os.sched_getaffinity(0))
    note = bind_local_rank({NODE_CPUS_VAR: node}, 0, 2, n, 0)  # 2 ranks of n threads on n CPUs
    assert "thread(s) each" in note, note
    elsewhere = bind_local_rank({NODE_CPUS_VAR: node + ",4096"}, 0, 2, 1, 0)
    assert "already bound to CPUs" in elsewhere, elsewhere


def test_the_per_node_launcher_passes_its_cpus_and_srun_tasks_get_none():
    plan = plan_launch({"DDPKIT_NPROC_PER_NODE": "2"}, python="/py", cpus=CPUs(4, ids=(0, 1, 2, 3)))
    assert plan.mode == "torchrun" and plan.env[NODE_CPUS_VAR] == "0-3"
    plan = plan_launch(SRUN, python="/py", cpus=CPUs(4, ids=(0, 1, 2, 3)))
    assert plan.mode == "srun" and NODE_CPUS_VAR not in plan.env


# Two real gloo ranks started like the launcher's workers: bind, join the group, all-reduce,
# then every thread's CPU list as the kernel has it (/proc/self/task/*/status).
TWO_RANKS = """
import json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from trainer.contract import parse_cpus
from trainer.host import bind_local_rank

def thread_cpus():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        status = open(f"/proc/self/task/{tid}/status").read()
        line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list:"))
        out[tid] = parse_cpus(line.split(":", 1)[1])
    return out

def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    note = bind_local_rank(os.environ, rank, 2, 1, 0)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.full((1 << 16,), float(rank + 1))
    dist.all_reduce(x)
    json.dump({"note": note, "threads": thread_cpus(), "sum": sorted(set(x.tolist()))}, open(f"{out}.{rank}", "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2, start_method="spawn")
"""


@linux
@pytest.mark.slow
@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: [])(0)) < 2, reason="needs 2 CPUs")
def test_each_rank_and_every_thread_it_starts_run_on_its_own_share(tmp_path):
    node = sorted(os.sched_getaffinity(0))
    out, script = tmp_path / "rank", tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    run = subprocess.run([sys.executable, str(script), str(free_port()), str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO), NODE_CPUS_VAR: format_cpus(node)})
    assert run.returncode == 0, run.stderr[-3000:]
    got = [json.loads(out.with_suffix(f".{r}").read_text()) for r in (0, 1)]
    want = shares(node, 2)
    for r, g in enumerate(got):
        assert g["note"].startswith(f"local rank {r} bound to CPUs {format_cpus(want[r])}"), g["note"]
        # gloo's and torch's threads started after the binding inherit it
        assert len(g["threads"]) >= 3 and all(c == want[r] for c in g["threads"].values()), g["threads"]
        assert g["sum"] == [3.0]
    assert not set(want[0]) & set(want[1])
