"""Hugging Face `transformers.Trainer`, as a user writes it (no ddpkit in it): a tiny BERT
built from a config (nothing downloaded), synthetic token sequences, `TrainingArguments` for
the CPU and gloo. Under torchrun the Trainer makes the process group and wraps the model in DDP.

FAULT (environment): unset: train STEPS steps and print `rank R/W: params sha256 HEX` of the
final parameters on each rank; `raise`: rank 1 raises at step 3; `hang`: rank 1 sleeps at step 8
(both in a callback, the Trainer's hook for your own code at each step)."""

import hashlib
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub: the model is built from a config

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

FAULT = os.environ.get("FAULT", "")
STEPS = int(os.environ.get("STEPS", "20"))


class Tokens(torch.utils.data.Dataset):
    """Random token sequences; the label is whether token 1 occurs in the first half."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(2, 64, (n, 16), generator=gen)
        self.ids[::2, 3] = 1
        self.labels = (self.ids[:, :8] == 1).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Faults(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if FAULT == "raise" and args.process_index == 1 and step == 3:
            raise RuntimeError("hf_trainer: an injected fault on rank 1 at step 3")  # FAULT=raise
        if FAULT == "hang" and args.process_index == 1 and step == 8:
            time.sleep(3600)  # FAULT=hang


def params_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir="hf-trainer-out",  # nothing is saved in it (save_strategy="no")
        max_steps=STEPS, per_device_train_batch_size=8, learning_rate=1e-3, use_cpu=True,
        ddp_backend="gloo", report_to=[], save_strategy="no", logging_steps=5,
        disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(STEPS * 16), callbacks=[Faults()])
    trainer.train()
    print(f"rank {args.process_index}/{args.world_size}: params sha256 {params_sha256(trainer.model)}",
          flush=True)


if __name__ == "__main__":
    main()
