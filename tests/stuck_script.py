"""A plain DDP script (no ddpkit) in which one rank gets stuck in its own code: rank
`HANG_RANK` (default 1) sleeps at step `HANG_STEP` (default 8; 0: before its first step, while
the others wait in DDP's first broadcast) while the others wait for it in a collective. The
process group's timeout is torch's default: whatever ends the run first, it is not that.
`asleep-rank<R>` in the working directory, and the line `asleep-rank<R> at <time>`, say when
the hang began."""

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def asleep(rank: int) -> None:
    open(f"asleep-rank{rank}", "w").close()
    print(f"asleep-rank{rank} at {time.time():.3f}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hang_rank, hang_step = int(os.environ.get("HANG_RANK", "1")), int(os.environ.get("HANG_STEP", "8"))
    torch.manual_seed(0)
    if rank == hang_rank and hang_step == 0:
        asleep(rank)
        time.sleep(3600)  # before the first step, outside any collective
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 1000):
        if rank == hang_rank and step == hang_step:
            asleep(rank)
            time.sleep(3600)  # in a step, outside any collective
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
