"""A textbook torchrun script (no ddpkit) in which one rank stops outside any collective:
`HANG_RANK` (default 1) sleeps at its 5th step while the others wait in an all-reduce, which
times out after `TIMEOUT_S` (the process group's timeout, default 10 s). The sleeping rank
first leaves a file `asleep-rank<R>` in the working directory (`OWN_SIGTERM=1`: own handler)."""

import datetime
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("TIMEOUT_S", "10"))))
    rank, t = dist.get_rank(), torch.ones(4)
    for step in range(1000):
        if rank == int(os.environ.get("HANG_RANK", "1")) and step == 5:
            open(f"asleep-rank{rank}", "w").close()  # for the tests: the hang began
            time.sleep(3600)  # outside any collective
        dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("OWN_SIGTERM"):  # as a framework would (Lightning): a flag for the loop
        import signal

        signal.signal(signal.SIGTERM, lambda signum, frame: print("own SIGTERM handler ran", flush=True))
    main()
