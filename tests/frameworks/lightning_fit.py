"""PyTorch Lightning, as a user writes it (no ddpkit in it): a LightningModule and
`Trainer(accelerator="cpu", strategy="ddp").fit(...)`, a tiny MLP on synthetic data. Under
torchrun Lightning joins the process group torchrun's environment describes; its `devices` and
`num_nodes` must match that world, so they are read from torchrun's variables.

FAULT (environment): unset: train STEPS steps and print `rank R/W: params sha256 HEX` of the
final parameters on each rank; `raise`: rank 1 raises at step 3; `hang`: rank 1 sleeps at step 8
(both in `training_step`)."""

import hashlib
import os
import time

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

FAULT = os.environ.get("FAULT", "")
STEPS = int(os.environ.get("STEPS", "20"))


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        step = self.global_step + 1
        if FAULT == "raise" and self.global_rank == 1 and step == 3:
            raise RuntimeError("lightning_fit: an injected fault on rank 1 at step 3")  # FAULT=raise
        if FAULT == "hang" and self.global_rank == 1 and step == 8:
            time.sleep(3600)  # FAULT=hang
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def params_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    pl.seed_everything(0, verbose=False)
    x = torch.randn(STEPS * 16, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(STEPS * 16, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # 8 per rank
    model = Regression()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=local_world,
                         num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local_world,
                         strategy="ddp", max_steps=STEPS, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    print(f"rank {trainer.global_rank}/{trainer.world_size}: params sha256 {params_sha256(model)}",
          flush=True)


if __name__ == "__main__":
    main()
