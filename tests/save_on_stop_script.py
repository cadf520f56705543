"""A torchrun script (no ddpkit) that saves on a stop with its own SIGTERM handler, as a
framework's would: rank 1's handler writes `ckpt-rank1.pt` with `torch.save`, which takes
`SAVE_S` seconds (an object slow to pickle: a large model on slow storage), then exits 143;
rank 0 waits in an all-reduce rank 1 never joins, so its handler never runs. Each rank leaves
`ready-rank<R>` in the working directory once both are in place."""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


class SlowToWrite:
    def __reduce__(self):
        time.sleep(float(os.environ.get("SAVE_S", "12")))
        return (dict, ())


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, t = dist.get_rank(), torch.ones(4)

    def on_stop(signum, frame):
        if rank == 1:
            torch.save({"weights": torch.arange(4.0), "slow": SlowToWrite()}, "ckpt-rank1.pt")
            print("rank 1 saved its checkpoint", flush=True)
            sys.exit(143)

    signal.signal(signal.SIGTERM, on_stop)
    dist.all_reduce(t)
    open(f"ready-rank{rank}", "w").close()
    if rank == 1:
        while True:
            time.sleep(1)  # outside any collective: its handler runs at once
    dist.all_reduce(t)  # never joined by rank 1


if __name__ == "__main__":
    main()
