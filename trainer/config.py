"""The `train:` and `checkpoint:` sections of a job file.

Owned by the trainer and importable without torch: `deploy.spec` embeds these models so a job
file is validated once, on the submitting machine, with the very rules the trainer applies.
The trainer itself reads the job file named by `DDPKIT_JOB_FILE` with plain yaml and these
models (`load_job_sections`), so it never imports `deploy`.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CheckpointConfig(BaseModel):
    """Where and how often the trainer checkpoints; also where a FINISHED marker is written."""

    model_config = ConfigDict(extra="forbid")

    dir: str = Field(
        "checkpoints",
        description="Checkpoint directory as seen inside every node (shared storage on multi-node "
        "jobs). A relative path is relative to the run directory (`<train.output_dir>/<run id>`).",
    )
    every_steps: int = Field(
        200, ge=1, le=10_000_000, description="Save a checkpoint every this many optimizer steps."
    )
    keep: int = Field(3, ge=1, le=1000, description="Keep this many newest checkpoints.")


class TrainConfig(BaseModel):
    """What the trainer trains: workload, data and optimisation settings."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "cnn",
        description="Workload: `cnn`, `gpt`, or a user function as `package.module:function` "
        "that takes this `train:` section and returns a `trainer.models.Workload`.",
    )
    model_args: dict[str, int | float | str | bool] = Field(
        default_factory=dict,
        description="Keyword arguments for the workload builder, e.g. for `gpt`: `d_model`, "
        "`layers`, `heads`, `seq_len`, `vocab`, `samples`.",
    )
    data: str = Field("synthetic", description="Data set: `synthetic` (built in).")
    data_samples: int | None = Field(
        None, ge=1, description="Train on only the first N samples of the data set (smoke runs)."
    )
    epochs: int = Field(1, ge=1, le=100_000, description="Passes over the data set.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (all epochs together)."
    )
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Samples per rank per step.")
    grad_accum: int = Field(
        1, ge=1, le=10_000,
        description="Micro-batches of `batch_size` per optimizer step (gradients are "
        "all-reduced once per step). Leftover micro-batches at the end of an epoch are skipped.",
    )
    lr: float = Field(0.01, gt=0, le=10, description="Learning rate.")
    optimizer: Literal["sgd", "adamw"] = Field("sgd", description="Optimizer: `sgd` or `adamw`.")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="Weight decay.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule after warm-up, decaying to 0 at the last step."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    grad_clip: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this value (off when unset)."
    )
    seed: int = Field(0, ge=0, description="Base random seed (each rank derives its own).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="`auto`: CUDA when available (backend nccl), else CPU (backend gloo)."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="`auto`: bf16 autocast on CUDA, fp32 on CPU. `fp16` adds a GradScaler."
    )
    compile: bool = Field(False, description="Compile the model with `torch.compile`.")
    channels_last: bool = Field(
        True,
        description="Keep 4-D weights and input batches channels-last: faster convolutions on CPU "
        "(oneDNN) and on tensor-core GPUs; no effect on models without 4-D tensors. Results equal "
        "the default layout's to float tolerance, not bit for bit.",
    )
    bucket_cap_mb: float = Field(
        25.0, gt=0, le=4096, description="DDP gradient bucket size in MiB."
    )
    find_unused_parameters: bool = Field(
        False, description="DDP `find_unused_parameters` (only for models that skip parameters)."
    )
    num_workers: int = Field(
        0, ge=0, le=256,
        description="DataLoader worker processes per rank (the built-in synthetic data sets are "
        "in memory and need none).",
    )
    threads: int | None = Field(
        None, ge=1, le=1024,
        description="CPU threads per rank (`torch.set_num_threads`); default: CPUs / local ranks.",
    )
    eval_every_epochs: int = Field(
        1, ge=0, description="Evaluate on the held-out set every N epochs and at the end (0: never)."
    )
    log_every_steps: int = Field(10, ge=1, description="Rank 0 logs a line every N steps.")
    output_dir: str = Field(
        "runs",
        description="Parent of the run directory `<output_dir>/<run id>` (run id: "
        "`DDPKIT_RUN_ID`, else the job name) that holds metrics.jsonl, the plot and the "
        "per-rank parameter checksums. Relative to the trainer's working directory.",
    )
    timeout_s: int = Field(
        600, ge=10, le=86_400,
        description="Seconds to wait for the master node and for collective operations.",
    )
    plot: bool = Field(True, description="Write `metrics.png` (loss and throughput) at the end.")


class JobSections(BaseModel):
    """What the trainer needs from a job file; every other key belongs to `deploy`."""

    name: str = "ddpkit"
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)


def load_job_sections(path: str | None = None) -> JobSections:
    """Read `name`, `train:` and `checkpoint:` from the job file (default: `$DDPKIT_JOB_FILE`).

    No job file means all defaults. The file was validated by `deploy` already; this re-check
    costs nothing and makes the trainer safe to start by hand.
    """
    import yaml

    path = path or os.environ.get("DDPKIT_JOB_FILE")
    if not path:
        return JobSections()
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a job file is a mapping")
    return JobSections.model_validate({
        "name": str(doc.get("name") or "ddpkit"),
        "train": doc.get("train") or {},
        "checkpoint": doc.get("checkpoint") or {},
    })


def error_line(exc: Exception) -> str:
    """One line for a bad job file: `train.lr: Input should be greater than 0` (first problem)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return f"{where}: {first['msg']}{more}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
