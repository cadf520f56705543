"""The stop vote (trainer/stop.py `StopVote`) in real 2-process gloo groups: both ranks stop at
the same step boundary, soon after one of them asked; votes are spaced by the steps' time;
`exact` (`DDPKIT_STOP_AT_STEP`) votes at every boundary."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.trainer_util import REPO
from trainer.stop import StopVote

RANK_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch.distributed as dist
    from trainer.stop import StopVote

    rank, port, ask_at, step_s, exact, out = sys.argv[1:7]
    rank, ask_at, step_s = int(rank), int(ask_at), float(step_s)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    vote = StopVote(None, True, exact=exact == "1")
    started = []
    start = vote.start
    vote.start = lambda requested: (started.append(vote.boundary), start(requested))
    stopped_at = None
    for boundary in range(1, 400):
        time.sleep(step_s)  # a step
        if vote.poll(rank == 1 and boundary >= ask_at):
            stopped_at = boundary
            break
    vote.close()
    json.dump({"stopped_at": stopped_at, "votes": started}, open(out, "w"))
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(tmp_path, ask_at: int, step_s: float, exact: bool) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(port), str(ask_at), str(step_s),
                               "1" if exact else "0", str(tmp_path / f"rank{r}.json")], cwd=REPO)
             for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_votes_are_spaced_by_the_step_time_and_capped():
    assert StopVote.steps_between(0, exact=False) == 1  # not known yet: the next boundary
    assert StopVote.steps_between(500_000, exact=False) == 1  # slow steps: every step
    assert StopVote.steps_between(20_000, exact=False) == 10  # 0.2 s of 20-ms steps
    assert StopVote.steps_between(100, exact=False) == StopVote.MAX_STEPS_BETWEEN
    assert StopVote.steps_between(20_000, exact=True) == 1


def test_both_ranks_stop_at_the_same_boundary_soon_after_one_asked_with_few_votes(tmp_path):
    ranks = two_ranks(tmp_path, ask_at=57, step_s=0.01, exact=False)
    assert ranks[0]["stopped_at"] == ranks[1]["stopped_at"]
    assert ranks[0]["votes"] == ranks[1]["votes"]  # the same schedule on both
    k = StopVote.steps_between(10_000, exact=False)
    assert 57 < ranks[0]["stopped_at"] <= 57 + 2 * k + 2  # ~10 ms steps, sleeps overshoot
    assert len(ranks[0]["votes"]) < ranks[0]["stopped_at"] / 4  # not one a step
    assert ranks[0]["votes"][:2] == [1, 2]  # the first two learn the step time


@pytest.mark.parametrize("ask_at", [5, 31])
def test_exact_votes_every_boundary_and_stops_one_step_after_the_request(tmp_path, ask_at):
    ranks = two_ranks(tmp_path, ask_at=ask_at, step_s=0.002, exact=True)
    assert [r["stopped_at"] for r in ranks] == [ask_at + 1, ask_at + 1]
    assert ranks[0]["votes"] == list(range(1, ask_at + 1))
