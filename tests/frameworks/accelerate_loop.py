"""A plain Accelerate training loop, as a user writes it (no ddpkit in it): `Accelerator()`,
`prepare(model, optimizer, dataloader)`, `accelerator.backward(loss)`. CPU, a tiny MLP on
synthetic data; under torchrun Accelerate makes the gloo process group itself.

FAULT (environment): unset: train STEPS steps and print `rank R/W: params sha256 HEX` of the
final parameters on each rank; `raise`: rank 1 raises at step 3; `hang`: rank 1 sleeps at step 8."""

import hashlib
import os
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

FAULT = os.environ.get("FAULT", "")
STEPS = int(os.environ.get("STEPS", "20"))


def params_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    x = torch.randn(STEPS * 16, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(STEPS * 16, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # 8 per rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rank = accelerator.process_index
    model.train()
    step = 0
    while step < STEPS:
        for inputs, targets in loader:
            step += 1
            if FAULT == "raise" and rank == 1 and step == 3:
                raise RuntimeError("accelerate_loop: an injected fault on rank 1 at step 3")  # FAULT=raise
            if FAULT == "hang" and rank == 1 and step == 8:
                time.sleep(3600)  # FAULT=hang
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step == STEPS:
                break
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    print(f"rank {rank}/{accelerator.num_processes}: params sha256 {params_sha256(unwrapped)}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
