"""Workloads: a model, its data and its loss. Built in: `cnn` and `gpt`; users: `pkg.mod:fn`.

The workload API (docs/WORKLOADS.md has a worked example, examples/own_workload/):
`train.model: package.module:function` names a function that takes the `train:` section
(`cfg`, a `trainer.config.TrainConfig`; your own settings are in `cfg.model_args`) and returns a
`Workload`. It is called on every rank after the process group exists, so it may use
`torch.distributed`, and it must build the same initial model on every rank (seed it).
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainer.config import ConfigError, TrainConfig
from trainer.data import synthetic_images, synthetic_tokens


@dataclass
class Workload:
    """What a workload function returns.

    Data: `train_data` (and `eval_data`) is a map-style `Dataset` (`len` and indexing; the
    trainer deals each step's global batch over the ranks: `trainer.data.GlobalBatches`) or an `IterableDataset` (the trainer gives
    rank r of n, and worker w of m, every (n*m)-th sample; set `iterable_sharded=True` when
    yours already yields only its share; `train.max_steps` is then required). Batches are made
    by `collate_fn` (default: torch's `default_collate`) and may be a tensor, a tuple/list, or a
    dict such as tokenizer output (`input_ids`, `attention_mask`, `labels`).

    Loss: with `loss_fn` (default `cross_entropy`) the batch is split into inputs and target:
    a tuple/list's last element, or a dict's `target_key` (default `labels`), is the target;
    the rest goes to `model(*inputs)` / `model(**inputs)`, and the loss is
    `loss_fn(output, target)`; eval accuracy is `argmax(output, -1) == target` over all
    elements (`accuracy=False` when that means nothing). With `loss_fn=None` the model computes
    its own loss: the whole batch goes to forward (labels included) and the loss is
    `output.loss`, `output["loss"]`, `output[0]` or the output itself.

    `optimizer(model)` builds a custom optimizer (parameter groups, any class) from the model
    before DDP wraps it; default: `train.optimizer`, `train.lr`, ... The LR schedule scales
    every group's own `lr`. `metrics(output, batch)` returns extra evaluation metrics, each
    the mean over the batch (a float or 0-d tensor); the trainer weights them by batch size,
    reduces them over ranks and reports them as `eval_<name>`.

    `static_graph=True` declares that every parameter that requires grad gets a gradient in every
    step, through the same graph (no step-dependent control flow that drops or adds parameters,
    no reentrant activation checkpointing a varying number of times): `train.static_graph: auto`
    then turns on DDP's `static_graph` (faster). Undeclared, auto leaves it off.
    """

    model: nn.Module
    train_data: Dataset
    eval_data: Dataset | None = None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = F.cross_entropy
    accuracy: bool = True
    collate_fn: Callable[[list[Any]], Any] | None = None
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    metrics: Callable[[Any, Any], dict[str, Any]] | None = None
    target_key: str = "labels"
    iterable_sharded: bool = False
    static_graph: bool = False


def make_cnn() -> nn.Module:
    """The reference CNN (build it after `torch.manual_seed(0)` to get the reference weights)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2048, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def cnn_workload(cfg: TrainConfig) -> Workload:
    train, held_out = synthetic_images(cfg.data_samples, held_out=cfg.eval_every_epochs > 0)
    torch.manual_seed(0)
    return Workload(make_cnn(), train, held_out, static_graph=True)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer (pre-norm, learned positions, causal SDPA)."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise ConfigError(f"train.model_args: d_model={d_model} is not divisible by heads={heads}")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


GPT_DEFAULTS = {"vocab": 256, "seq_len": 128, "d_model": 256, "layers": 4, "heads": 4, "samples": 8192}


def gpt_workload(cfg: TrainConfig) -> Workload:
    unknown = set(cfg.model_args) - set(GPT_DEFAULTS)
    if unknown:
        raise ConfigError(
            f"train.model_args: unknown key(s) {sorted(unknown)} for gpt; known: {sorted(GPT_DEFAULTS)}"
        )
    a = {**GPT_DEFAULTS, **cfg.model_args}
    for key, value in a.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"train.model_args.{key}: {value!r} must be a positive integer for gpt")
    samples = cfg.data_samples or int(a["samples"])
    train, held_out = synthetic_tokens(samples, int(a["seq_len"]), int(a["vocab"]))
    torch.manual_seed(0)
    model = GPT(int(a["vocab"]), int(a["seq_len"]), int(a["d_model"]), int(a["layers"]), int(a["heads"]))
    return Workload(model, train, held_out, loss_fn=_token_loss, static_graph=True)


BUILTIN = {"cnn": cnn_workload, "gpt": gpt_workload}  # keys: trainer.config.BUILTIN_MODELS


#: Built-in workloads made before a fork by the node's template process (trainer/warm.py), by
#: `workload_key`: a forked worker takes its own copy-on-write copy instead of building one.
PREBUILT: dict[str, Workload] = {}


def workload_key(cfg: TrainConfig) -> str | None:
    """What a built-in workload is a function of (it is made from fixed seeds, so equal keys
    give equal tensors); None for a user's workload (its function may do anything)."""
    if cfg.model not in BUILTIN:
        return None
    return json.dumps([cfg.model, cfg.model_args, cfg.data, cfg.data_samples, cfg.eval_every_epochs > 0],
                      sort_keys=True)


def prebuild(cfg: TrainConfig) -> str | None:
    """Build `cfg`'s built-in workload into `PREBUILT` (the template, before it forks); its name."""
    key = workload_key(cfg)
    if key is not None:
        PREBUILT[key] = build_workload(cfg)
        return cfg.model
    return None


def build_workload(cfg: TrainConfig) -> Workload:
    """Build the workload named by `train.model` (`cnn`, `gpt` or `package.module:function`)."""
    key = workload_key(cfg)
    if key is not None and key in PREBUILT:
        return PREBUILT.pop(key)
    if cfg.model in BUILTIN:
        if cfg.data != "synthetic":
            raise ConfigError(f"train.data: {cfg.model!r} has only the 'synthetic' data set")
        if cfg.model == "cnn" and cfg.model_args:
            raise ConfigError("train.model_args: the cnn workload takes no arguments; remove them")
        return BUILTIN[cfg.model](cfg)
    module_name, sep, func_name = cfg.model.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(
            f"train.model: {cfg.model!r} is neither a built-in ({', '.join(BUILTIN)}) nor "
            "'package.module:function'"
        )
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"train.model: cannot load {cfg.model!r}: {e}") from None
    workload = func(cfg)
    if not isinstance(workload, Workload):
        raise ConfigError(f"train.model: {cfg.model!r} returned {type(workload).__name__}, not a Workload")
    return workload
