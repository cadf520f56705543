"""A plain torchrun DDP script that knows nothing of ddpkit (the `script:` example).

The textbook recipe: `init_process_group` from torchrun's environment, a `DistributedSampler`
with `set_epoch`, `DistributedDataParallel`, zero_grad/backward/step. Every rank prints the
sha256 of its final parameters (and writes it to `<out>/params-rank<R>.sha256`), so a run on
any target can be checked for identical results across ranks:

    torchrun --nproc-per-node 2 train.py --epochs 2 --out runs/own-script
    ddpkit run examples/own-script.yaml --local     # the same, through ddpkit's launcher
"""

import argparse
import hashlib
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--out", default="runs/own-script")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    g = torch.Generator().manual_seed(0)  # the same data set on every rank
    x = torch.randn(args.samples, 16, generator=g)
    y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).long()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them anyway)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2)).to(device),
                device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb.to(device)), yb.to(device))
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

    h = hashlib.sha256()
    for name, t in model.module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    digest = h.hexdigest()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"params-rank{rank}.sha256"), "w") as f:
        f.write(digest + "\n")
    print(f"rank {rank}/{world} on {socket.gethostname()}: params sha256 {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
