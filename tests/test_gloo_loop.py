"""`train.gloo_loop_idle` (trainer/host.py): the kernel's view of each thread's policy is the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.trainer_util import REPO, free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE and /proc: Linux")

# Two real gloo ranks: one all-reduce (gloo's threads exist), then idle_gloo_loops, then the
# kernel's policy of every thread of the process by name, and all-reduces that must still sum.
TWO_RANKS = """
import json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from trainer.host import LOOP_THREAD, idle_gloo_loops, loop_threads

def policies():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        out.setdefault(name, []).append(os.sched_getscheduler(int(tid)))
    return out

def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    before = loop_threads()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.ones(1 << 18)
    dist.all_reduce(x)
    note = idle_gloo_loops()
    sums = []
    for i in range(20):
        x = torch.full((1 << 18,), float(rank + 1 + i))
        dist.all_reduce(x)
        sums.append(sorted(set(x.tolist())))
    json.dump({"before": before, "note": note, "policies": policies(), "sums": sums,
               "idle": os.SCHED_IDLE, "other": os.SCHED_OTHER}, open(f"{out}.{rank}", "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2, start_method="spawn")
"""


@pytest.mark.slow
def test_only_gloos_event_loop_goes_idle_and_collectives_still_sum(tmp_path):
    out, script = tmp_path / "rank", tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    run = subprocess.run([sys.executable, str(script), str(free_port()), str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads(out.with_suffix(f".{rank}").read_text())
        assert r["before"] == []  # no group, no loop thread
        assert r["note"].startswith("gloo event loop at idle priority (1 thread(s)"), r["note"]
        pol = r["policies"]
        assert pol["gloo_tcp_loop"] == [r["idle"]], pol
        # everything else keeps the normal policy: the main thread, torch's collective threads
        others = [p for name, ps in pol.items() if name != "gloo_tcp_loop" for p in ps]
        assert others and set(others) == {r["other"]}, pol
        assert "pt_gloo_runloop" in pol, pol
        assert r["sums"] == [[float(3 + 2 * i)] for i in range(20)]


def test_without_a_process_group_there_is_nothing_to_make_idle():
    code = ("from trainer.host import idle_gloo_loops, loop_threads; import torch; "
            "print(loop_threads()); print(idle_gloo_loops())")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["[]", "gloo event loop left alone (no gloo_tcp_loop thread in this process)"]
