"""A worked example of the workload API: your own model and data in ddpkit's trainer.

`train.model: examples.own_workload.tiny_lm:build` (examples/own-workload.yaml). The function
gets the job's `train:` section and returns a `trainer.models.Workload`; everything else (DDP,
sampler, checkpoints, resume, evaluation across ranks, metrics.jsonl) is the trainer's.

What it shows, as a Hugging Face-style model would need it:
- samples are dicts of variable-length token lists; `collate_fn` pads them into a dict batch
  `{input_ids, attention_mask, labels}` (labels -100 on padding);
- the model computes its own loss from `labels` (`Workload(loss_fn=None)`): the trainer calls
  `model(**batch)` and uses `output.loss`;
- a map-style data set, its held-out part split off with `torch.utils.data.random_split`, or
  (`model_args.data.iterable: true`) an `IterableDataset` the trainer shards across ranks;
- a custom optimizer with parameter groups (no weight decay on biases and norms);
- an extra evaluation metric (token accuracy on non-padding tokens);
- nested `model_args` (mappings, lists) read from the job file.

How it reaches every node: it is imported by module name, so it must be importable where the
trainer runs. The trainer's working directory is on `sys.path`: `ddpkit run --local` from the
repository root and Slurm (the submit directory) find `examples/own_workload/` there; in a
container, bake it into the image (`FROM ddpkit:0.1` + `COPY examples/ /workspace/examples/`)
or mount it with a volume and add the mount to `PYTHONPATH` in `env:`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, random_split

from trainer.config import TrainConfig
from trainer.models import Workload

DEFAULTS = {
    "model": {"vocab": 32, "d_model": 32, "hidden": [64]},
    "data": {"samples": 1024, "min_len": 4, "max_len": 12, "eval_fraction": 0.125, "iterable": False},
    "optimizer": {"lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.99]},
}


def sequence(i: int, vocab: int, min_len: int, max_len: int) -> list[int]:
    """Sample i: an arithmetic token sequence of a sample-dependent length (learnable)."""
    g = torch.Generator().manual_seed(i)
    length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
    start, stride = (int(v) for v in torch.randint(0, vocab, (2,), generator=g))
    return [(start + k * (stride % 5 + 1)) % vocab for k in range(length)]


class Sequences(Dataset):
    def __init__(self, n: int, **kw):
        self.n, self.kw = n, kw

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": sequence(i, **self.kw)}


class StreamOfSequences(IterableDataset):
    """The same samples as a stream (think: lines of files read in order)."""

    def __init__(self, start: int, stop: int, **kw):
        self.start, self.stop, self.kw = start, stop, kw

    def __iter__(self):
        for i in range(self.start, self.stop):
            yield {"input_ids": sequence(i, **self.kw)}


def pad_batch(samples: list[dict]) -> dict[str, torch.Tensor]:
    """collate_fn: pad to the longest sequence; next-token labels, -100 where nothing to predict."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[row, : len(s["input_ids"])] = 1
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(mask[:, 1:] == 1, ids[:, 1:], -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclass
class LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(nn.Module):
    """Embedding -> MLP over (token, previous token) -> logits; computes its loss from labels."""

    def __init__(self, vocab: int, d_model: int, hidden: list[int]):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layers, width = [], 2 * d_model
        for h in hidden:
            layers += [nn.Linear(width, h), nn.LayerNorm(h), nn.GELU()]
            width = h
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask, labels=None) -> LMOutput:
        x = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        logits = self.head(self.mlp(torch.cat([x, prev], dim=-1)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return LMOutput(loss, logits)


def token_accuracy(output: LMOutput, batch: dict) -> dict[str, float]:
    """Extra eval metric: the mean over the batch (the trainer weights and reduces it)."""
    labels = batch["labels"]
    keep = labels != -100
    correct = (output.logits.argmax(-1) == labels) & keep
    return {"token_accuracy": float(correct.sum() / keep.sum().clamp(min=1))}


def merged(defaults: dict, given: dict) -> dict:
    unknown = set(given) - set(defaults)
    if unknown:
        raise ValueError(f"train.model_args: unknown key(s) {sorted(unknown)}; known: {sorted(defaults)}")
    return {k: ({**v, **given.get(k, {})} if isinstance(v, dict) else given.get(k, v)) for k, v in defaults.items()}


def build(cfg: TrainConfig) -> Workload:
    a = merged(DEFAULTS, cfg.model_args)
    m, d, o = a["model"], a["data"], a["optimizer"]
    seq = {"vocab": m["vocab"], "min_len": d["min_len"], "max_len": d["max_len"]}
    n = cfg.data_samples or d["samples"]
    n_eval = max(1, int(n * d["eval_fraction"]))
    if d["iterable"]:
        train, held_out = StreamOfSequences(0, n - n_eval, **seq), StreamOfSequences(n - n_eval, n, **seq)
    else:  # map-style, the held-out part split off as torch users do
        train, held_out = random_split(Sequences(n, **seq), [n - n_eval, n_eval],
                                       generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM(m["vocab"], m["d_model"], list(m["hidden"]))

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for n_, p in model.named_parameters() if p.dim() > 1 and "embed" not in n_]
        rest = [p for n_, p in model.named_parameters() if not (p.dim() > 1 and "embed" not in n_)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                                  {"params": rest, "weight_decay": 0.0}],
                                 lr=o["lr"], betas=tuple(o["betas"]))

    return Workload(model, train, held_out, loss_fn=None, collate_fn=pad_batch,
                    optimizer=optimizer, metrics=token_accuracy)
