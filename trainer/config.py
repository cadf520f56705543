"""The `train:` and `checkpoint:` sections of a job file.

Owned by the trainer and importable without torch: `deploy.spec` embeds these models so a job
file is validated once, on the submitting machine, with the very rules the trainer applies.
The trainer itself reads the job file named by `DDPKIT_JOB_FILE` with plain yaml and these
models (`load_job_sections`), so it never imports `deploy`.
"""

# No `from __future__ import annotations` in a module of pydantic models: pydantic would
# compile and evaluate each field's annotation from its text (`ddpkit render` reads them all).

import os
import re
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from trainer.contract import JOB_FILE_VAR, STOP_GRACE_S_VAR

#: The built-in workloads (trainer/models.py builds them; `deploy` validates `train.model`
#: against this list without importing torch).
BUILTIN_MODELS = ("cnn", "gpt")

# -- your own torchrun script instead of the built-in trainer ---------------------------------
# Top-level fields of a job file (`script:`, `module:`, `args:`), defined here once: `deploy.spec`
# uses these very types, and `trainer.launch` reads them from the job file every target delivers.

TRAINER_ENTRY = ("-m", "trainer.train")  # the built-in trainer, as `python -m trainer.train`
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _script(value: str | None) -> str | None:
    if value is not None and (not value.strip() or value.startswith("-")):
        raise ValueError(f"{value!r} is not a script path; give a file such as train.py")
    return value


def _module(value: str | None) -> str | None:
    if value is not None and not MODULE_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not a Python module name such as mypkg.train")
    return value


def _arg(value: Any) -> Any:
    """`args: [--epochs, 3]`: numbers become strings; booleans and nulls are ambiguous."""
    if isinstance(value, bool) or value is None:
        raise ValueError("ambiguous YAML value (yes/no/true/null); quote it, e.g. \"true\"")
    return str(value) if isinstance(value, (int, float)) else value


#: torchrun options the launcher derives itself (trainer.launch.plan_launch), with the field that
#: sets each; `torchrun_args` may not repeat them.
LAUNCHER_TORCHRUN_OPTIONS = {
    "--nnodes": "nodes", "--nproc-per-node": "gpus_per_node / procs_per_node",
    "--nproc_per_node": "gpus_per_node / procs_per_node", "--node-rank": "the scheduler",
    "--node_rank": "the scheduler", "--rdzv-backend": "the launcher (c10d)",
    "--rdzv_backend": "the launcher (c10d)", "--rdzv-endpoint": "the target (node 0)",
    "--rdzv_endpoint": "the target (node 0)", "--rdzv-id": "name", "--rdzv_id": "name",
    "--rdzv-conf": "train.timeout_s", "--rdzv_conf": "train.timeout_s",
    "--max-restarts": "restarts", "--max_restarts": "restarts", "--master-addr": "the target",
    "--master_addr": "the target", "--master-port": "the target", "--master_port": "the target",
    "--standalone": "nodes", "--signals-to-handle": "the launcher",
    "--signals_to_handle": "the launcher", "--shutdown-timeout": f"k8s.termination_grace ({STOP_GRACE_S_VAR})",
    "--shutdown_timeout": f"k8s.termination_grace ({STOP_GRACE_S_VAR})", "-m": "module", "--module": "module",
    "--no-python": "script", "--no_python": "script",
}


def _torchrun_args(value: list[str]) -> list[str]:
    for arg in value:
        option = arg.split("=", 1)[0]
        if option in LAUNCHER_TORCHRUN_OPTIONS:
            raise ValueError(f"{option}: the launcher sets it from {LAUNCHER_TORCHRUN_OPTIONS[option]}; "
                             "set that instead")
        if not arg.startswith("-"):
            raise ValueError(f"{arg!r}: give options (`--monitor-interval=1`, `--log-dir=/out`), "
                             "each with its value after '='; the program is `script` or `module`")
    return value


TorchrunArgs = Annotated[list[Annotated[str, BeforeValidator(_arg)]], AfterValidator(_torchrun_args), Field(
    description="Extra torchrun options, each `--option=value` (`--monitor-interval=1`, "
    "`--local-addr=...`, `--log-dir=...`), put before the program on every node; the options the "
    "launcher derives (`--nnodes`, `--rdzv-*`, `--max-restarts`, ...) are refused.")]


Script = Annotated[str | None, AfterValidator(_script), Field(
    description="Your own torchrun script, started instead of the built-in trainer by the same "
    "launcher (env contract, master wait, restarts, port choice, signals): each node runs "
    "`torchrun ... SCRIPT ARGS`. A path on every node, relative to its working directory: the "
    "image's WORKDIR (`/workspace` in ddpkit's image) on Kubernetes and Docker, the submit "
    "directory on Slurm, the current directory for `run --local`; with `workdir`, the snapshot "
    "of that tree on every target (and the path must be in it). Of the `train:` section only "
    "`timeout_s`, `threads` and the hang watchdog's `watchdog`, `hang_floor_s` and `hang_factor` apply.")]
Module = Annotated[str | None, AfterValidator(_module), Field(
    description="Like `script`, a module run as `python -m MODULE ARGS` (`torchrun ... -m MODULE "
    "ARGS`); it must be importable on every node (installed in the image, or on PYTHONPATH).")]
Args = Annotated[list[Annotated[str, BeforeValidator(_arg)]], Field(
    description="Arguments of `script` or `module` (numbers are passed as strings).")]
Steps = Annotated[int | None, Field(
    ge=1, description="How many optimizer steps your `script` or `module` will take in all (every "
    "rank counts its optimizer's steps with no change to the script): `ddpkit status` then gives "
    "an ETA. The built-in trainer's are `train.max_steps` / `train.epochs`.")]


def _local_rank_arg(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"--[A-Za-z][A-Za-z0-9_-]*", value):
        raise ValueError(f"{value!r}: give the option your script reads, as `--local_rank` or `--local-rank`")
    return value


LocalRankArg = Annotated[str | None, AfterValidator(_local_rank_arg), Field(
    description="For a script written for `torch.distributed.launch`, which reads its local rank "
    "from an argument: each rank gets `OPTION=N` (`--local_rank=0`, `--local_rank=1`, ...) before "
    "`args`, as that launcher gave it (torchrun, and so ddpkit, give `LOCAL_RANK` in the "
    "environment only; without this every rank would parse its argparse default, often 0).")]


def entry_problems(script: str | None, module: str | None, args: list[str],
                   command: list[str] | None = None, steps: int | None = None,
                   local_rank_arg: str | None = None) -> list[tuple[str, str, str]]:
    """What is wrong with a job's choice of program, as (field, message, fix); empty: nothing."""
    problems = []
    if script is not None and module is not None:
        problems.append(("module", "script and module are both set", "give one of them"))
    if command is not None and (script is not None or module is not None):
        problems.append(("command", "replaces the launcher; with script or module the launcher "
                         "starts your code", "remove command"))
    if args and script is None and module is None:
        problems.append(("args", "are the arguments of script or module", "set one of them"))
    if steps is not None and script is None and module is None:
        problems.append(("steps", "counts the steps of your script or module; the built-in trainer's "
                         "come from train.max_steps and train.epochs", "remove it, or set script"))
    if local_rank_arg is not None and script is None and module is None:
        problems.append(("local_rank_arg", "passes the local rank to your script or module; the built-in "
                         "trainer reads LOCAL_RANK", "remove it, or set script"))
    return problems


def entry_argv(script: str | None, module: str | None, args: list[str]) -> list[str]:
    """What follows `python` (or torchrun's options): the user's program, else the trainer."""
    if script is not None:
        return [script, *args]
    if module is not None:
        return ["-m", module, *args]
    return list(TRAINER_ENTRY)


class ConfigError(ValueError):
    """A bad setting found at run time (the trainer exits 2 with this one line, no traceback).

    Only ddpkit's own checks raise it; any other exception, a `ValueError` from a loss
    function included, is a failure of the run: traceback, exit 1.
    """


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
    async_save: bool = Field(
        False,
        description="Write checkpoints in the background: training blocks only while the state is "
        "copied to host memory; the file is published atomically as a synchronous save would be, "
        "and the last save (end of training, SIGTERM) is always complete before the exit.",
    )
    ephemeral: bool = Field(
        False, description="Accept that the checkpoint directory may not survive a restart "
        "(ddpkit refuses a multi-node job or one with restarts whose checkpoints would be lost, "
        "unless this is true; deploy/durability.py). The trainer ignores it.",
    )


class TrainConfig(BaseModel):
    """What the trainer trains: workload, data and optimisation settings."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "cnn",
        description="Workload: `cnn`, `gpt`, or a user function as `package.module:function` "
        "that takes this `train:` section and returns a `trainer.models.Workload`.",
    )
    model_args: dict[str, Any] = Field(
        default={},  # copied for each instance; cheaper to build than default_factory=dict (deploy/spec.py Strict)
        description="Arguments for the workload builder (`cfg.model_args` in your function), any "
        "YAML value: numbers, strings, lists, mappings. For `gpt`: `d_model`, `layers`, `heads`, "
        "`seq_len`, `vocab`, `samples`.",
    )
    data: str = Field("synthetic", description="Data set: `synthetic` (built in).")

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        module, sep, name = v.partition(":")
        if v not in BUILTIN_MODELS and not (sep and module and name):
            raise ValueError(f"{v!r} is neither a built-in workload ({', '.join(BUILTIN_MODELS)}) "
                             "nor 'package.module:function'; use one of those")
        return v
    data_samples: int | None = Field(
        None, ge=1, description="Train on only the first N samples of the data set (smoke runs)."
    )
    epochs: int = Field(1, ge=1, le=100_000, description="Passes over the data set.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (all epochs together)."
    )
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Samples per rank per micro-batch "
                            "(per step without grad_accum). The global batch is ranks x batch_size x "
                            "grad_accum; a run resumed on another number of ranks keeps it, with "
                            "micro-batches of at most this size.")
    grad_accum: int = Field(
        1, ge=1, le=10_000,
        description="Micro-batches of `batch_size` per optimizer step (gradients are "
        "all-reduced once per step). An epoch is the data set's size // the global batch "
        "steps; the samples left over are skipped.",
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
        "auto",
        description="`auto`: bf16 autocast on a GPU that supports it, fp16 with a GradScaler on "
        "one that does not, fp32 on CPU. `fp16` adds a GradScaler (a step it skips does not "
        "advance the LR schedule).",
    )
    compile: bool = Field(False, description="Compile the model with `torch.compile`.")
    deterministic: bool = Field(
        False,
        description="GPU jobs: cuDNN and cuBLAS use deterministic algorithms only "
        "(`torch.use_deterministic_algorithms`, cuDNN autotuning off, "
        "`CUBLAS_WORKSPACE_CONFIG=:4096:8`), so that a run resumed from a checkpoint ends bit for "
        "bit equal to an uninterrupted one on the same GPUs, as runs on CPU always do; slower, and "
        "an operation with no deterministic GPU kernel stops the run naming it.",
    )
    channels_last: bool = Field(
        True,
        description="Keep 4-D weights and input batches channels-last: faster convolutions on CPU "
        "(oneDNN) and on tensor-core GPUs; no effect on models without 4-D tensors. Results equal "
        "the default layout's to float tolerance, not bit for bit.",
    )
    bucket_cap_mb: float = Field(
        25.0, gt=0, le=4096, description="DDP gradient bucket size in MiB."
    )
    ddp_comm_hook: Literal["none", "fp16", "bf16"] = Field(
        "none",
        description="Compress gradients for the all-reduce (DDP communication hook): `fp16` or "
        "`bf16` halve the bytes sent, at some precision; bf16 needs NCCL (a GPU). Worth it when "
        "the network, not compute, bounds the step (bench/step_profile.py measures it).",
    )
    find_unused_parameters: bool = Field(
        False, description="DDP `find_unused_parameters` (only for models that skip parameters)."
    )
    sync_batchnorm: bool = Field(
        False,
        description="Convert BatchNorm layers to `SyncBatchNorm` (statistics over all ranks; "
        "GPUs only, as in torch). Without it BatchNorm running statistics are rank-local.",
    )
    broadcast_buffers: bool = Field(
        True, description="DDP `broadcast_buffers`: rank 0's buffers are copied to every rank "
        "before each forward."
    )
    static_graph: Literal["auto"] | bool = Field(
        "auto",
        description="DDP `static_graph`: the model uses every parameter, the same way, every step, "
        "so DDP may skip per-step bookkeeping (bench/step_profile.py: `baseline` vs `dynamic_graph`); "
        "results are unchanged (tested bit for bit). `auto`: "
        "on for a workload that declares it static (`cnn`, `gpt`; yours with "
        "`Workload(static_graph=True)`), off with `find_unused_parameters`, `grad_accum` > 1 "
        "(torch fails under `no_sync`) or `compile`; rank 0 logs the choice and why. `true` on a "
        "model whose used parameters change is a one-line error at the step after the change.",
    )
    num_workers: int = Field(
        0, ge=0, le=256,
        description="DataLoader worker processes per rank (the built-in synthetic data sets are "
        "in memory and need none).",
    )
    threads: int | None = Field(
        None, ge=1, le=1024,
        description="CPU threads per rank (`torch.set_num_threads`, and `OMP_NUM_THREADS` for the ranks: it wins over one in `env`); default: the job's OMP_NUM_THREADS, else CPUs / local ranks.",
    )
    warm_restarts: bool = Field(
        True,
        description="The built-in trainer's workers are forked from a per-node template process "
        "that imported torch and the trainer once, so a restarted group skips those imports "
        "(trainer/warm.py); false: each worker is a fresh `python -m trainer.train`. "
        "`DDPKIT_WARM=0`/`1` on a node overrides it (1 also forks a `script` or `module` job's "
        "workers, which otherwise start cold).",
    )
    keep_freed_memory: bool = Field(
        True,
        description="On CPU, each rank keeps the memory a step frees for the next step (glibc malloc: "
        "mmap threshold 32 MiB, trim threshold 128 MiB) instead of page-faulting it back in every "
        "step. A rank's memory then stays near its peak; a job's own `GLIBC_TUNABLES` malloc settings "
        "win (trainer/host.py). No effect on GPU jobs.",
    )
    bind_cpus: bool = Field(
        True,
        description="On CPU, bind each local rank to its own equal share of the CPUs the node's "
        "launcher may use (hyperthread siblings together), so that gloo's threads of a rank run on "
        "the cores the rank frees when it blocks on the all-reduce. Left to the scheduler, with the "
        "reason logged, for one rank per node, a share smaller than the rank's threads, "
        "`num_workers` > 0, a worker something else already bound (taskset, numactl, srun) or "
        "another launcher (trainer/host.py). No effect on GPU jobs.",
    )
    gloo_loop_idle: bool = Field(
        True,
        description="On CPU (gloo), run gloo's TCP event-loop thread at idle priority (SCHED_IDLE): "
        "it busy-polls while a collective's thread holds the connection (pytorch/gloo#246) and, at "
        "normal priority, takes the core from the very thread it waits for. It then runs only "
        "when a core is free: set false when other CPU-bound work shares the cores in the same "
        "cgroup (trainer/host.py). No effect with nccl.",
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
    watchdog: bool = Field(
        True,
        description="The hang watchdog: a rank that stops making progress is found within "
        "`hang_floor_s` (or `hang_factor` x the p99 step), every rank's stacks are written to "
        "RUN_DIR/debug/attempt-N/ with a verdict naming the stuck rank, and the attempt ends "
        "(exit 124: a restart, counted against `restarts`). docs/faults.md \"Hangs\".",
    )
    stop_on_nonfinite_loss: bool = Field(
        True,
        description="Stop with FloatingPointError (naming the step and the rank) when a rank's "
        "loss is NaN or infinite: checked every `log_every_steps` steps, where the losses are "
        "read anyway (no extra device sync).",
    )
    hang_floor_s: float = Field(20.0, ge=1, le=86_400, description="The watchdog's shortest deadline for a step's phases.")
    hang_factor: float = Field(10.0, ge=1, le=1000, description="The watchdog's deadline for a step's phases: this x the p99 step time of the attempt (at least `hang_floor_s`).")
    straggler_factor: float = Field(
        1.5, ge=1.05, le=100,
        description="A rank whose own time a step (data, forward, backward up to its last "
        "gradient bucket, optimizer: no waiting for the others) is over this x the other ranks' median in 5 windows of `log_every_steps` steps "
        "in a row is named the straggler: in rank 0's log, `ddpkit status` and the summary. "
        "docs/faults.md \"Stragglers\".",
    )
    prometheus_port: int | None = Field(
        None, ge=1024, le=65535,
        description="Rank 0 serves its counters (step, samples/s, loss, goodput and its time "
        "classes, restarts) for Prometheus at `http://HOST:PORT/metrics`; off by default. "
        "docs/watching.md \"Prometheus\" has the scrape annotations.",
    )
    prometheus_textfile: str | None = Field(
        None, min_length=1,
        description="Rank 0 rewrites the same counters in Prometheus' text format to this file "
        "(relative: to the run directory) once a second, for node_exporter's textfile collector; "
        "off by default.",
    )


class JobSections(BaseModel):
    """What the trainer needs from a job file; every other key belongs to `deploy`."""

    model_config = ConfigDict(defer_build=True)  # the trainer's alone: `deploy` never builds it

    name: str = "ddpkit"
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    script: Script = None
    module: Module = None
    args: Args = []
    torchrun_args: TorchrunArgs = []
    steps: Steps = None
    local_rank_arg: LocalRankArg = None
    # resources.cpus_per_node (owned by deploy): what the job asked for, for threads per rank
    cpus_per_node: float | None = None
    # gpus_per_node (owned by deploy): None without a job file (the trainer started by hand)
    gpus_per_node: int | None = None
    preflight: bool = False  # run trainer.preflight's checks before the entry (JobSpec.preflight)
    restarts: int = 0  # JobSpec.restarts: how many restarts the target allows (the progress record)

    @model_validator(mode="after")
    def _entry(self) -> Self:
        problems = entry_problems(self.script, self.module, self.args, steps=self.steps,
                                  local_rank_arg=self.local_rank_arg)
        if problems:
            raise ValueError("; ".join(f"{path}: {message}; {fix}" for path, message, fix in problems))
        return self

    @property
    def entry(self) -> list[str]:
        return entry_argv(self.script, self.module, self.args)


def load_job_sections(path: str | None = None) -> JobSections:
    """Read what the trainer and the launcher need from the job file (default: `$DDPKIT_JOB_FILE`):
    `name`, `train:`, `checkpoint:`, `script`/`module`/`args`, `gpus_per_node` and
    `resources.cpus_per_node`.

    No job file means all defaults. The file was validated by `deploy` already; this re-check
    costs nothing and makes the trainer safe to start by hand.
    """
    import yaml

    path = path or os.environ.get(JOB_FILE_VAR)
    if not path:
        return JobSections()
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a job file is a mapping")
    resources = doc.get("resources") if isinstance(doc.get("resources"), dict) else {}
    return JobSections.model_validate({
        "name": str(doc.get("name") or "ddpkit"),
        "train": doc.get("train") or {},
        "checkpoint": doc.get("checkpoint") or {},
        **{k: doc[k] for k in ("script", "module", "args", "torchrun_args", "steps", "local_rank_arg")
           if doc.get(k) is not None},
        "cpus_per_node": resources.get("cpus_per_node"),
        "gpus_per_node": int(doc.get("gpus_per_node") or 0),
        "preflight": bool(doc.get("preflight")),
        "restarts": int(doc.get("restarts") or 0),
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
