"""The `train:` and `checkpoint:` sections of a job file.

Owned by the trainer and importable without torch: `deploy.spec` embeds these models so a job
file is validated once, on the submitting machine, with the very rules the trainer applies.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CheckpointConfig(BaseModel):
    """Where and how often the trainer checkpoints; also where a FINISHED marker is written."""

    model_config = ConfigDict(extra="forbid")

    dir: str = Field(
        "checkpoints",
        description="Checkpoint directory as seen inside every node (shared storage on multi-node "
        "jobs). Relative paths are relative to the working directory of the trainer.",
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
        description="Workload: `cnn`, `gpt`, or a user function as `package.module:function`.",
    )
    data: str = Field("synthetic", description="Data set: `synthetic` (built in).")
    epochs: int = Field(1, ge=1, le=100_000, description="Passes over the data set.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (all epochs together)."
    )
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Samples per rank per step.")
    lr: float = Field(0.01, gt=0, le=10, description="Learning rate.")
    seed: int = Field(0, ge=0, description="Base random seed (each rank derives its own).")
