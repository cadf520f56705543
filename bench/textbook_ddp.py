"""The textbook DDP loop on the `cnn` workload, as a plain script (start it with torchrun).

Nothing from ddpkit is used: init from env, DistributedSampler + set_epoch, DDP,
CrossEntropyLoss, SGD, zero_grad/backward/step. The data and model are the `cnn` workload's
definition, rebuilt here by hand. Rank 0 writes a JSON report to the path in argv[1]:
per-step losses, steady-state samples/s (first 20 steps excluded), time from launch
(`DDPKIT_LAUNCH_T0`) to the end of the first step, and a checksum of the final parameters
computed like the trainer's.

    torchrun --nproc-per-node 2 bench/textbook_ddp.py out.json [max_steps] [threads]
"""

import hashlib
import json
import os
import sys
import time

T0 = float(os.environ.get("DDPKIT_LAUNCH_T0") or time.time())
MARKS = {"worker started": time.time() - T0}  # timestamps for bench/launch_time.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

MARKS["torch imported"] = time.time() - T0


def main() -> None:
    out = sys.argv[1]
    max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10**9
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    MARKS["process group"] = time.time() - T0

    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (16384,), generator=g)
    x = torch.randn(16384, 3, 32, 32, generator=g) + 0.5 * templates[y]
    dataset = TensorDataset(x, y)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2048, 128), nn.ReLU(), nn.Linear(128, 10),
    )
    ddp = DDP(model)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    MARKS["data, model, DDP, optimizer"] = time.time() - T0

    losses, stamps, step, first_step_s = [], [], 0, None
    epoch = 0
    while step < max_steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            losses.append(loss.item())
            stamps.append(time.perf_counter())
            if first_step_s is None:
                first_step_s = time.time() - T0
                MARKS["first step"] = first_step_s
            if step >= max_steps:
                break
        epoch += 1

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    skip = 20 if len(stamps) > 21 else 1
    steady = (len(stamps) - skip) * 64 * world / (stamps[-1] - stamps[skip - 1]) if len(stamps) > 1 else None
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "samples_per_s": steady, "first_step_s": first_step_s,
                       "world_size": world, "params_sha256": h.hexdigest(), "launch_marks": MARKS}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
