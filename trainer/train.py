"""The DDP training loop every target ends in (`python -m trainer.train`, one per rank).

It computes what the textbook DDP loop computes (DistributedSampler's order and split, DDP,
zero_grad/backward/step) and adds what a job needs: gradient accumulation with `no_sync`,
clipping, bf16 autocast on CUDA, an LR schedule, evaluation reduced across ranks, exact
resume from checkpoints (at any world size the global batch splits over), a graceful stop on SIGTERM/SIGUSR2/SIGINT, `metrics.jsonl` and a
plot in the run directory.

Exit codes (`trainer.contract`, docs/CONTRACT.md): `EXIT_OK` (0) done (or FINISHED marker
already there); `EXIT_STOPPED` (143) stopped by a signal after writing a checkpoint;
`EXIT_STOPPED_UNSAVED` (137) stopped by a signal before a checkpoint of that moment could be
written (while joining the process group or setting up, or no step boundary acted in time); both
retryable; `EXIT_FAILURE` (1) failure; `EXIT_BAD_CONFIG` (2) bad configuration.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import random
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import attempts
from trainer.contract import (
    EXIT_BAD_CONFIG,
    EXIT_OK,
    EXIT_STOPPED,
    LAUNCH_T0_VAR,
    STOP_AT_STEP_VAR,
    STOP_FILE_VAR,
    TORCHRUN_T0_VAR,
)
from trainer.forked import FORKED, worker_t0
from trainer.metrics import Recorder
from trainer.progress import Ledger
from trainer.stop import StopRequest, StopVote, say, stop_here
from trainer.watchdog import Watchdog

log = logging.getLogger("ddpkit.trainer")


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base learning rate before optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def tensors_sha256(named: Any) -> str | None:
    """sha256 over `(name, tensor)` pairs (name and raw bytes); None when there are none."""
    import torch

    h, any_ = hashlib.sha256(), False
    for name, t in named:
        any_ = True
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest() if any_ else None


def params_sha256(module: Any) -> str:
    """sha256 over every parameter: DDP keeps them equal on all ranks."""
    return tensors_sha256(module.named_parameters()) or hashlib.sha256().hexdigest()


def buffers_sha256(module: Any) -> str | None:
    """sha256 over every buffer (BatchNorm running statistics, ...); None without buffers."""
    return tensors_sha256((n, b) for n, b in module.named_buffers() if b is not None)


def rank_local_buffers(module: Any) -> bool:
    """True when buffers legitimately differ across ranks: a (non-Sync) BatchNorm tracking
    running statistics updates them from its own rank's batches after DDP's broadcast."""
    from torch import nn

    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
               and m.track_running_stats for m in module.modules())


def native_bf16() -> bool:
    """bf16 in the GPU's hardware (compute capability 8.0 and up): torch's `is_bf16_supported()`
    also says yes where it can only emulate bf16 (a T4), far slower than fp16 there."""
    import torch

    return torch.cuda.is_bf16_supported(including_emulation=False)


def autocast_dtype(precision: str, device_type: str, bf16_supported: bool) -> str | None:
    """The autocast dtype name (`bfloat16`, `float16`) or None for fp32.

    `auto`: bf16 on a GPU that has it, fp16 (with a GradScaler) on one that does not (e.g.
    V100, T4), fp32 on CPU. `fp16` needs CUDA; `bf16` on a GPU without it is refused.
    """
    from trainer.config import ConfigError

    if precision == "fp16" and device_type != "cuda":
        raise ConfigError("train.precision: fp16 needs CUDA; use bf16 or fp32 on CPU")
    if precision == "bf16" and device_type == "cuda" and not bf16_supported:
        raise ConfigError("train.precision: this GPU has no native bf16 (compute capability below 8.0; torch would emulate it, slowly); use fp16 or auto")
    if precision == "auto":
        if device_type != "cuda":
            return None
        return "bfloat16" if bf16_supported else "float16"
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision)


def step_optimizer(optimizer: Any, scaler: Any) -> bool:
    """One optimizer step (through the GradScaler with fp16); False when the scaler skipped it
    (inf/NaN gradients), so the caller does not advance the LR schedule."""
    if scaler is None:
        optimizer.step()
        return True
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= before  # the scale only shrinks on a skipped step


def choose_static_graph(cfg: Any, declared: bool, accum: int) -> tuple[bool, str]:
    """DDP's `static_graph` for `train.static_graph` (`auto`, true, false), and why (for the
    log), given whether the workload declares a static graph and the micro-batches a step.

    torch 2.13's DDP asks of a static graph that the set of parameters used (and how they are
    used) is the same every step. Without `find_unused_parameters` DDP already fails at the next
    step when a parameter gets no gradient, so a run that works with the default has every
    parameter used every step; what remains is a graph that changes otherwise, which only the
    workload knows: `auto` trusts its declaration (`Workload.static_graph`; the built-in ones
    declare it). Off under `auto` as well: with `find_unused_parameters` (the used set may change
    by design), with accumulation (DDP(static_graph=True) fails an internal assertion when the
    first step's backward runs under `no_sync`, pytorch/pytorch#143580), and with `compile`
    (DDPOptimizer with static_graph has had bugs, pytorch/pytorch#109261; not verified here).
    Forced true with accumulation is refused (ConfigError).
    """
    from trainer.config import ConfigError

    setting = cfg.static_graph
    if isinstance(setting, bool):
        if setting and accum > 1:
            raise ConfigError(f"train.static_graph: true fails with {accum} micro-batches a step (train.grad_accum, "
                              "or a resume on fewer ranks that keeps the global batch): torch's DDP asserts when "
                              "the first step's backward skips the all-reduce (no_sync); set train.static_graph: "
                              "auto or false")
        return setting, f"train.static_graph: {str(setting).lower()}"
    if setting != "auto":
        raise ConfigError(f"train.static_graph: {setting!r} is not auto, true or false")
    if cfg.find_unused_parameters:
        return False, "auto: train.find_unused_parameters is true (the parameters used may change between steps)"
    if accum > 1:
        return False, f"auto: {accum} micro-batches a step (torch's static_graph fails under no_sync)"
    if cfg.compile:
        return False, "auto: train.compile is true (static_graph under torch.compile is not verified here)"
    if not declared:
        return False, (f"auto: the workload {cfg.model!r} does not declare Workload(static_graph=True) "
                       "(every parameter used, the same way, every step)")
    return True, f"auto: the workload {cfg.model!r} uses every parameter, the same way, every step"


def world_size_refusal(path: str, state: dict[str, Any], world: int, ckpt_dir: Path, reason: str) -> str:
    """Why a checkpoint of another world size is not resumed (one line). A run resumes on any
    number of ranks that its global batch splits over (Trainer.adopt_global_batch); this says
    which it cannot, and what to do."""
    divisors = [n for n in range(1, min(state.get("global_batch") or 0, 64) + 1) if state["global_batch"] % n == 0]
    fits = f"run with {state['world_size']} ranks" + (
        f" (or any of {', '.join(map(str, divisors))})" if divisors and "evenly" in reason else "")
    return (f"checkpoint {path} (step {state['step']}) was written by {state['world_size']} ranks, this run "
            f"has {world}: {reason}; {fits} (nodes x processes per node), or start afresh with another "
            f"checkpoint.dir (or delete {ckpt_dir})")


def run_directory(cfg: Any, job_name: str) -> Path:
    return attempts.run_directory(cfg.output_dir, job_name)


@dataclass
class Session:
    """What one `Trainer.train` keeps from step to step (its records are the `Recorder`'s)."""

    step_loss: Any = None  # the loss summed over the micro-batches of the step in progress
    last_eval: dict[str, float] | None = None
    last_eval_step: int = -1
    stopped: bool = False


class Trainer:
    def __init__(self, job: Any, denv: Any, device: Any, stop: StopRequest, t0: float,
                 ledger: Ledger | None = None):
        import torch
        import torch.distributed as dist

        self.job, self.cfg, self.denv, self.device, self.stop, self.t0 = job, job.train, denv, device, stop, t0
        self.rank, self.world = denv.rank, denv.world_size
        self.is_main = denv.is_main
        self.run_dir = run_directory(self.cfg, job.name)
        ckpt = Path(job.checkpoint.dir)
        self.ckpt_dir = ckpt if ckpt.is_absolute() else self.run_dir / ckpt
        self.distributed = denv.distributed and dist.is_initialized()
        # Control traffic (stop vote, small objects) on a CPU group even when training uses nccl.
        self.control = None
        if self.distributed and dist.get_backend() != "gloo":
            import datetime

            self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
        self.vote = StopVote(self.control, self.distributed, exact=stop.after_step > 0)
        # everything recorded beside the math: heartbeat, ledger, progress, metrics, stragglers
        self.recorder = Recorder(self.cfg, self.run_dir, self.rank, self.is_main, t0, ledger)
        self.watchdog: Watchdog | None = None
        self.torch = torch

    # -- small helpers ------------------------------------------------------------------
    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.control)

    def to_device(self, batch: Any) -> Any:
        from trainer.data import to_device

        return to_device(batch, self.device, self.memory_format)

    def forward_loss(self, module: Any, batch: Any) -> tuple[Any, Any, Any]:
        """(loss, output, target) of one batch on the device (see `trainer.models.Workload`)."""
        from trainer.data import model_loss, split_batch

        w = self.workload
        args, kwargs, target = split_batch(batch, w.loss_fn is None, w.target_key)
        with self.autocast():
            output = module(*args, **kwargs)
            loss = model_loss(output) if w.loss_fn is None else w.loss_fn(output, target)
        return loss, output, target

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    # -- setup --------------------------------------------------------------------------
    def already_finished(self) -> bool:
        from trainer import checkpoint

        step = checkpoint.finished_step(self.ckpt_dir) if self.is_main else None
        step = self.broadcast(step)
        if step is not None and self.is_main:
            log.info(
                "%s exists (finished at step %d): nothing to do; delete it to train further",
                self.ckpt_dir / checkpoint.FINISHED, step,
            )
        return step is not None

    def setup(self) -> None:
        """Everything before the first step, in this order (each part needs the ones before):
        the model (seeded per rank after it exists), precision, optimizer, data and step count,
        LR schedule, resume, then DDP (after resume: every rank holds the same weights anyway)."""
        self.setup_model()
        self.setup_precision()
        self.setup_optimizer()
        self.setup_data()
        self.setup_schedule()
        self.recorder.mark("optimizer+loader")
        self.recorder.start_progress(self.total_steps, self.cfg.epochs, self.global_batch, self.job.restarts)
        self.start_watchdog()
        self.recorder.beat("checkpoint_load")
        with self.recorder.ledger.during("checkpoint_load"):
            self.resume()
        self.recorder.beat("setup")
        self.setup_ddp()

    def start_watchdog(self) -> None:
        """`train.watchdog` on a distributed run: every rank's thread, on this attempt's number
        (rank 0's, from the run directory's records)."""
        attempt = self.broadcast(self.recorder.attempt)
        if not (self.cfg.watchdog and self.distributed):
            return

        def on_hang(found: dict[str, Any]) -> None:  # rank 0: the hang in its ledger, the last record
            self.recorder.hung(found, self.step, self.epoch)

        self.watchdog = Watchdog(self.recorder.hb, rank=self.rank, world=self.world, attempt=attempt,
                                 debug_dir=self.run_dir / "debug" / f"attempt-{attempt}",
                                 floor_s=self.cfg.hang_floor_s, factor=self.cfg.hang_factor,
                                 timeout_s=self.cfg.timeout_s, on_hang=on_hang if self.is_main else None)
        self.watchdog.start()

    def setup_model(self) -> None:
        """The workload, the per-rank seeds, and the model on the device (SyncBatchNorm,
        channels_last)."""
        import torch

        from trainer.config import ConfigError
        from trainer.models import build_workload

        cfg, device = self.cfg, self.device
        self.workload = build_workload(cfg)
        self.recorder.mark("workload built")
        # Seeds per rank, after the model exists (model init is identical on every rank).
        self.seed = cfg.seed + self.rank
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        with contextlib.suppress(ImportError):
            import numpy as np

            np.random.seed(self.seed)
        model = self.workload.model
        if cfg.sync_batchnorm:
            if device.type != "cuda":
                raise ConfigError("train.sync_batchnorm: torch's SyncBatchNorm runs on GPUs only; "
                                  "remove it on CPU (BatchNorm statistics are then rank-local)")
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = model.to(device)
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        if cfg.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)

    def setup_precision(self) -> None:
        """`self.autocast` (a context factory) and, for fp16, the GradScaler."""
        import torch

        device = self.device
        name = autocast_dtype(self.cfg.precision, device.type,
                              device.type == "cuda" and native_bf16())
        dtype = getattr(torch, name) if name else None
        self.autocast = (
            (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else contextlib.nullcontext
        )
        self.scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 else None

    def setup_optimizer(self) -> None:
        """The workload's own optimizer, else `train.optimizer` (sgd or adamw)."""
        import torch

        from trainer.config import ConfigError

        cfg = self.cfg
        if self.workload.optimizer is not None:
            self.optimizer = self.workload.optimizer(self.model)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise ConfigError(f"train.model: {cfg.model!r}'s optimizer returned "
                                  f"{type(self.optimizer).__name__}, not a torch.optim.Optimizer")
        elif cfg.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(
                self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
            )
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def setup_data(self) -> None:
        """This rank's loader and the run's step count (`total_steps`)."""
        from trainer.data import collate, is_iterable

        self.collate = self.workload.collate_fn or collate
        self.iterable = is_iterable(self.workload.train_data)
        if self.iterable:
            self.setup_iterable_data()
        else:
            self.setup_sampled_data()

    def setup_iterable_data(self) -> None:
        """An IterableDataset: each rank reads its shard; `train.max_steps` is the step count."""
        from torch.utils.data import DataLoader

        from trainer.config import ConfigError
        from trainer.data import RankShard

        cfg = self.cfg
        if cfg.max_steps is None:
            raise ConfigError("train.max_steps: an IterableDataset has no length, so the "
                              "schedule needs a step count; set train.max_steps")
        self.batches = None
        self.shard = RankShard(self.workload.train_data, self.rank, self.world, cfg.seed,
                               self.workload.iterable_sharded)
        self.loader = DataLoader(
            self.shard, batch_size=cfg.batch_size, collate_fn=self.collate,
            num_workers=cfg.num_workers, pin_memory=self.device.type == "cuda",
        )  # workers are made per epoch: they see the shard's epoch
        self.micro_per_epoch = None
        self.micro_batch, self.accum = cfg.batch_size, cfg.grad_accum
        self.global_batch = cfg.batch_size * cfg.grad_accum * self.world
        self.total_steps = cfg.max_steps

    def setup_sampled_data(self) -> None:
        """A map-style data set: global batches (resumable inside an epoch, at any world size);
        the step count is epochs x whole steps per epoch, at most `train.max_steps`."""
        self.lay_out(self.cfg.batch_size, self.cfg.grad_accum)

    def lay_out(self, micro: int, accum: int) -> None:
        """This rank's batches and loader for `micro` samples x `accum` micro-batches a step
        (trainer/data.py `GlobalBatches`), and the step count that follows."""
        import torch
        from torch.utils.data import DataLoader

        from trainer.config import ConfigError
        from trainer.data import GlobalBatches, WorkerSeeded

        cfg, data = self.cfg, self.workload.train_data
        self.batches = GlobalBatches(len(data), cfg.seed, self.rank, self.world, micro, accum)
        self.micro_batch, self.accum, self.global_batch = micro, accum, self.batches.global_batch
        self.loader = DataLoader(
            WorkerSeeded(data) if cfg.num_workers > 0 else data,
            batch_sampler=self.batches,
            collate_fn=self.collate,
            num_workers=cfg.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
            # Workers reseed per batch (WorkerSeeded), so this only keeps the global RNG untouched.
            generator=torch.Generator().manual_seed(self.seed),
        )
        self.micro_per_epoch = len(self.batches)
        if self.batches.steps == 0:
            raise ConfigError(
                f"train.batch_size: {self.world} ranks x {micro} x grad_accum {accum} = {self.global_batch} "
                f"samples a step is more than the data set ({len(data)} samples); make them smaller"
            )
        self.total_steps = cfg.epochs * self.batches.steps
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

    def make_scheduler(self) -> None:
        """The LR schedule, in optimizer steps of the run's global batch (a step is the same
        number of samples at any world size, so the schedule is one in samples too)."""
        import torch

        total, warmup, schedule = self.total_steps, self.cfg.warmup_steps, self.cfg.lr_schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, warmup, schedule)
        )

    def setup_schedule(self) -> None:
        """The LR schedule over `total_steps`, and the run's position: step 0 until `resume`."""

        from trainer.checkpoint import AsyncSaver

        self.make_scheduler()
        self.step, self.epoch, self.micro = 0, 0, 0
        self.resumed_from: int | None = None
        self.last_saved = -1  # the step of the newest checkpoint (resume sets it too)
        self.saver = AsyncSaver()  # used by rank 0 with checkpoint.async_save

    def setup_ddp(self) -> None:
        """DDP around the model on more than one rank (comm hook too), `torch.compile` if asked:
        `self.forward` is what the steps call."""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from trainer.config import ConfigError

        cfg, device = self.cfg, self.device
        self.ddp = None
        self.buckets_settled = False  # settle_buckets, before the first step of this attempt
        wrapped = self.model
        if self.distributed and self.world > 1:
            static, self.static_why = choose_static_graph(cfg, self.workload.static_graph, self.accum)
            self.ddp = DDP(
                self.model,
                device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=cfg.bucket_cap_mb,
                gradient_as_bucket_view=True,
                find_unused_parameters=cfg.find_unused_parameters,
                static_graph=static,
                # torch 2.13 warns whenever the argument is given; False keeps its meaning
                **({} if cfg.broadcast_buffers else {"broadcast_buffers": False}),
            )
            if self.is_main:
                log.info("DDP: bucket_cap_mb %s, find_unused_parameters %s, broadcast_buffers %s, "
                         "static_graph %s (%s), sync_batchnorm %s", cfg.bucket_cap_mb, cfg.find_unused_parameters,
                         cfg.broadcast_buffers, static, self.static_why, cfg.sync_batchnorm)
            wrapped = self.ddp
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                    "bf16": default_hooks.bf16_compress_hook}[cfg.ddp_comm_hook]
            try:  # timed: when the last bucket was handed over (trainer/stragglers.py)
                self.ddp.register_comm_hook(None, self.recorder.bucket_clock.wrap(hook))
            except TypeError as e:  # bf16 on gloo: "BF16 all reduce communication hook required CUDA..."
                raise ConfigError(f"train.ddp_comm_hook: {cfg.ddp_comm_hook} is not available here "
                                  f"({str(e).splitlines()[0]}); use fp16 or none") from None
        if self.ddp is not None and device.type == "cpu":  # CPU (gloo) runs only
            from trainer import host

            host.tune_gloo(cfg, self.is_main)  # DDP's broadcast at construction started gloo's threads
        self.forward = torch.compile(wrapped) if cfg.compile else wrapped
        self.recorder.mark("DDP")

    # -- checkpoints --------------------------------------------------------------------
    def rng_state(self) -> dict[str, Any]:
        import numpy as np

        state = {"torch": self.torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if self.device.type == "cuda":
            state["cuda"] = self.torch.cuda.get_rng_state(self.device)
        return state

    def checkpoint_state(self, rng: list[dict[str, Any]]) -> dict[str, Any]:
        """What a checkpoint holds (live tensors: save or copy it before training goes on)."""
        epoch, micro = self.epoch, self.micro
        if self.micro_per_epoch is not None and micro >= self.micro_per_epoch:  # saved at an epoch end
            epoch, micro = epoch + 1, 0
        return {
            "step": self.step,
            "epoch": epoch,
            "micro_batches_done": micro,  # this rank's, in this epoch
            "samples_done": micro // self.accum * self.global_batch,  # the epoch's global cursor
            "global_batch": self.global_batch,  # = world_size x micro_batch x grad_accum
            "micro_batch": self.micro_batch,
            "grad_accum": self.accum,
            "world_size": self.world,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": rng,
            "train": self.cfg.model_dump(),
        }

    def save(self, final: bool = False) -> None:
        """Checkpoint the current step. With `checkpoint.async_save` (and not `final`) rank 0
        only copies the state to host memory and a background thread writes it; other ranks
        move on at once. A final save (end of training, stop) is complete on return."""
        # a stop's final checkpoint is booked as part of the stop
        booked = None if self.recorder.ledger.phase == "stop" else "checkpoint_save"
        with self.recorder.during("checkpoint", booked):
            self._save(final)

    def _save(self, final: bool) -> None:
        from trainer import checkpoint

        background = self.job.checkpoint.async_save and not final
        t = time.perf_counter()
        rng = self.all_gather(self.rng_state())
        if self.is_main:
            state = self.checkpoint_state(rng)
            if background:
                self.saver.submit(self.ckpt_dir, self.step, state, self.job.checkpoint.keep)
                blocking = time.perf_counter() - t
                log.info("checkpoint of step %d copied in %.3fs; writing it in the background", self.step, blocking)
            else:
                self.saver.wait()  # an older background save is published first
                path = checkpoint.save(self.ckpt_dir, self.step, state, self.job.checkpoint.keep)
                blocking = time.perf_counter() - t
                log.info("checkpoint %s (%.2fs)", path, blocking)
            self.recorder.write({"event": "checkpoint", "step": self.step, "blocking_s": blocking, "background": background})
        if not background:
            self.barrier()  # nobody exits (or moves on) before the file is complete
        self.last_saved = self.step

    def finish_saves(self) -> None:
        """Wait for a background save in flight; afterwards every rank knows it is published."""
        if self.is_main:
            self.saver.wait()
        if self.job.checkpoint.async_save:
            self.barrier()

    def resume(self) -> None:
        from trainer import checkpoint

        skipped: list[dict[str, Any]] = []
        path = checkpoint.newest_valid(self.ckpt_dir, skipped) if self.is_main else None
        path = self.broadcast(None if path is None else str(path))
        if skipped:  # `ddpkit why`: a resume that went further back
            self.recorder.resumed(checkpoint=path, skipped=skipped)
        if path is None:
            return
        # Every rank reads the file when it can see it (shared storage); else rank 0 sends it.
        visible = self.all_gather(os.path.exists(path))
        if all(visible):
            state = checkpoint.load(Path(path))
        else:
            state = self.broadcast(checkpoint.load(Path(path)) if self.is_main else None)
        same_world = state["world_size"] == self.world
        if state.get("global_batch", self.global_batch) != self.global_batch or not same_world:
            self.adopt_global_batch(state, path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.micro = (state["samples_done"] // self.global_batch * self.accum if "samples_done" in state
                      else state["micro_batches_done"])  # a checkpoint of an older ddpkit: same world
        if same_world:  # the RNG states between micro-batches (every micro-batch reseeds itself)
            self.restore_rng(state["rng"][self.rank])
        changed = [k for k in ("model", "model_args", "data", "data_samples", "batch_size", "grad_accum", "seed")
                   if state.get("train", {}).get(k) != getattr(self.cfg, k)]
        if changed and self.is_main:
            log.warning("train.%s changed since the checkpoint was written: the resumed run is "
                        "not the one that was interrupted", ", train.".join(changed))
        self.resumed_from = self.step
        self.last_saved = self.step
        self.recorder.resumed(checkpoint=path, step=self.step)
        if self.is_main:
            log.info("resumed from %s (step %d, epoch %d)", path, self.step, self.epoch)
            self.recorder.write({"event": "resumed", "step": self.step, "checkpoint": path})

    def restore_rng(self, rng: dict[str, Any]) -> None:
        import numpy as np

        self.torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if "cuda" in rng and self.device.type == "cuda":
            self.torch.cuda.set_rng_state(rng["cuda"], self.device)

    def adopt_global_batch(self, state: dict[str, Any], path: str) -> None:
        """Resume a checkpoint written by another number of ranks (or with another batch
        setting): keep its global batch, as this many ranks x the largest micro-batch up to
        `train.batch_size` x accumulation (trainer/data.py `layout_for`); the step count and the
        LR schedule follow from it. Refused (one line) for an iterable data set (its position
        is per rank) and for a global batch that does not split evenly over the ranks."""
        from trainer.config import ConfigError
        from trainer.data import layout_for

        old = state.get("global_batch")
        try:
            if self.iterable or old is None:
                raise ValueError("the data position of an IterableDataset is per rank" if self.iterable
                                 else "it was written by a ddpkit without a global data position")
            micro, accum = layout_for(old, self.world, self.cfg.batch_size)
        except ValueError as e:
            raise ConfigError(world_size_refusal(path, state, self.world, self.ckpt_dir, str(e))) from None
        total = self.total_steps
        self.lay_out(micro, accum)
        if self.total_steps != total:
            self.make_scheduler()
        self.recorder.resized(self.total_steps, self.global_batch)
        if self.is_main:
            log.info("checkpoint %s was written by %d ranks x %d x grad_accum %d; this run keeps its global "
                     "batch of %d samples as %d ranks x %d x grad_accum %d", path, state["world_size"],
                     state["micro_batch"], state["grad_accum"], old, self.world, micro, accum)

    # -- evaluation ---------------------------------------------------------------------
    def eval_loader(self) -> Any:
        """This rank's share of the held-out set, unpadded (exact metrics), in batches."""
        from torch.utils.data import DataLoader

        from trainer.data import RankShard, is_iterable

        data, bs = self.workload.eval_data, self.cfg.batch_size
        if is_iterable(data):
            shard = RankShard(data, self.rank, self.world, self.cfg.seed, self.workload.iterable_sharded)
            return DataLoader(shard, batch_size=bs, collate_fn=self.collate)
        mine = list(range(self.rank, len(data), self.world))
        return DataLoader(data, batch_sampler=[mine[i : i + bs] for i in range(0, len(mine), bs)],
                          collate_fn=self.collate)

    def evaluate(self) -> dict[str, float] | None:
        """Loss (and accuracy, and the workload's metrics) over the whole held-out set: every
        rank evaluates its share; the sums are added over ranks."""
        from trainer.data import batch_samples

        torch, w = self.torch, self.workload
        if w.eval_data is None:
            return None
        self.model.eval()
        accuracy = w.accuracy and w.loss_fn is not None
        sums: dict[str, Any] = {}  # loss*n, correct, n (targets), samples, metric*samples

        def add(key: str, value: Any) -> None:
            sums[key] = sums.get(key, 0.0) + value

        with torch.no_grad():
            for batch in self.eval_loader():
                batch = self.to_device(batch)
                loss, out, target = self.forward_loss(self.model, batch)
                samples = batch_samples(batch)
                n = target.numel() if w.loss_fn is not None else samples
                add("loss", loss.detach().double() * n)
                if accuracy:
                    add("correct", (out.argmax(-1) == target).sum())
                add("n", n)
                add("samples", samples)
                for k, v in (w.metrics(out, batch) if w.metrics else {}).items():
                    add(f"metric:{k}", float(v) * samples)
        local = {k: float(v) for k, v in sums.items()}
        total: dict[str, float] = {}
        for part in self.all_gather(local):  # small Python numbers on the CPU control group
            for k, v in part.items():
                total[k] = total.get(k, 0.0) + v
        self.model.train()
        n, samples = max(total.get("n", 0.0), 1.0), max(total.get("samples", 0.0), 1.0)
        result = {"eval_loss": total.get("loss", 0.0) / n}
        if accuracy:
            result["eval_accuracy"] = total.get("correct", 0.0) / n
        for k in sorted(k for k in total if k.startswith("metric:")):
            result[f"eval_{k.removeprefix('metric:')}"] = total[k] / samples
        return result

    # -- the loop -----------------------------------------------------------------------
    def all_true(self, flag: bool) -> bool:
        """True when `flag` is true on every rank (a MIN all-reduce on the control group)."""
        if not self.distributed:
            return flag
        import torch.distributed as dist

        t = self.torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return bool(t.item())

    def epoch_batches(self) -> Any:
        """The rest of this epoch's micro-batches on this rank (a resumed epoch skips the ones
        trained on before the checkpoint). An iterable data set's epoch ends on every rank when
        the shortest shard does, so no rank waits in an all-reduce the others never join."""
        if not self.iterable:
            self.batches.start(self.epoch, self.micro)
            for batch in self.loader:
                if self.micro >= self.micro_per_epoch:
                    return
                yield batch
            return
        self.shard.set_epoch(self.epoch)
        batches = iter(self.loader)
        for _ in range(self.micro):
            next(batches, None)
        while True:
            batch = next(batches, None)
            if not self.all_true(batch is not None):
                return
            yield batch

    def train(self) -> int:
        """The loop of named steps (like torchtitan's `train_step`), then the end of the run:
        the final checkpoint, the last evaluation, the summary. `EXIT_OK`, or `EXIT_STOPPED`
        after a stop whose checkpoint is complete on every rank."""
        s = self.session = Session()
        self.recorder.start_session(self.total_steps, self.step, self.global_batch)
        self.stop.phase = "training"
        self.recorder.tick(self.step, self.epoch, force=True)
        try:
            while self.step < self.total_steps and self.epoch < self.cfg.epochs and not s.stopped:
                self.end_epoch(exhausted=self.train_epoch())
        except BaseException:  # a peer died, an error of the workload: the attempt's last record
            if self.watchdog is not None:
                self.watchdog.stop()
            self.recorder.failed(self.step, self.epoch, hang_booked=bool(self.watchdog and self.watchdog.fired))
            raise
        self.end_loop()
        self.final_checkpoint()
        status = "stopped" if s.stopped else "completed"
        if s.stopped:
            self.report_stop()
        else:
            self.final_evaluation()
        self.recorder.beat("finish")
        self.publish(self.summary(status), status)
        if self.watchdog is not None:
            self.watchdog.stop()
        return EXIT_STOPPED if s.stopped else EXIT_OK

    def train_epoch(self) -> bool:
        """The steps of the rest of this epoch: True when its data ran out, False when the run's
        last step or a stop ended it."""
        self.recorder.beat("data")
        for batch in self.epoch_batches():
            if not self.train_step(batch):
                self.recorder.beat("data")
                continue  # inside a gradient accumulation
            self.recorder.log_step(self.step)
            self.recorder.compare_ranks(self.step, self.all_gather if self.distributed and self.world > 1 else None)
            self.maybe_checkpoint()
            # The stop vote is a collective: every rank takes part at every step boundary.
            if self.handle_stop() or self.step >= self.total_steps:
                return False
            self.recorder.beat("data")
        return True

    def train_step(self, batch: Any) -> bool:
        """One micro-batch forward and backward; after the last of an accumulation, the
        optimizer step. True when an optimizer step was taken."""
        if not self.forward_backward_step(batch):
            return False
        lr = self.optimizer_step()
        s, accum = self.session, self.accum
        self.recorder.step_done(self.step, self.epoch, s.step_loss / accum if accum > 1 else s.step_loss, lr, self.sync)
        s.step_loss = None
        return True

    def forward_backward_step(self, batch: Any) -> bool:
        """Loss and gradients of one micro-batch (DDP syncs them only on the last micro-batch of
        an accumulation: `no_sync` before); True when it was that last one."""
        s, accum = self.session, self.accum
        if self.batches is not None:  # random draws depend on the micro-batch, not on the rank count
            from trainer.data import seed_everything

            seed_everything(self.batches.seed_of(self.micro, stream=1))
        batch = self.to_device(batch)
        if not self.buckets_settled:
            self.settle_buckets(batch)
        last_micro = (self.micro + 1) % accum == 0
        sync_ctx = self.ddp.no_sync() if (self.ddp is not None and not last_micro) else contextlib.nullcontext()
        with sync_ctx, self.static_graph_broken():
            self.recorder.forward(self.step)
            loss, _, _ = self.forward_loss(self.forward, batch)
            scaled = loss / accum if accum > 1 else loss
            with self.recorder.backward():  # DDP's all-reduce runs in here
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        s.step_loss = loss.detach() if s.step_loss is None else s.step_loss + loss.detach()
        self.micro += 1
        return last_micro

    def settle_buckets(self, batch: Any) -> None:
        """Let DDP rebuild its gradient buckets before the first real step of every attempt.

        With static_graph or without find_unused_parameters, DDP reduces a process's first
        backward in one bucket of every parameter, then rebuilds its buckets in the order the
        gradients became ready (with static_graph the first backward is reduced all at once at
        its end, and the rebuild follows the second). gloo and NCCL sum an element across ranks
        in an order set by its place in the bucket, and with 3 or more ranks float sums depend
        on that order: the first steps after a resume would not sum as the uninterrupted run's
        same steps did, and the final parameters would differ in their last bits (measured: 3
        ranks of cnn; 2 ranks are immune, a + b == b + a). So throwaway forwards and backwards
        (the loss times 0: gradients of 0, no optimizer step; RNG states and buffers such as
        BatchNorm's statistics put back) run first, one (two with static_graph), and every real
        step of every attempt sums with the rebuilt buckets: one or two steps' compute more at
        each start, on 3 ranks or more only."""
        self.buckets_settled = True
        ddp = self.ddp
        if ddp is None or self.world < 3 or (self.cfg.find_unused_parameters and not ddp.static_graph):
            return  # nothing to rebuild, or an order that cannot matter
        rng = self.rng_state()
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        for _ in range(2 if ddp.static_graph else 1):
            with self.static_graph_broken():
                self.recorder.forward(self.step)
                loss, _, _ = self.forward_loss(self.forward, batch)
                with self.recorder.backward(timed=False):
                    (loss * 0).backward()
            self.optimizer.zero_grad(set_to_none=True)
        with self.torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        self.restore_rng(rng)

    @contextlib.contextmanager
    def static_graph_broken(self):
        """torch's error for a graph that changed under DDP's `static_graph` (raised in the
        forward or backward after the change, on every rank) as one line naming the setting."""
        try:
            yield
        except RuntimeError as e:
            if self.ddp is None or not self.ddp.static_graph or "static_graph" not in str(e):
                raise
            from trainer.config import ConfigError

            fix = ("set train.static_graph: false" if self.static_why.startswith("train.")
                   else f"remove static_graph=True from the Workload of {self.cfg.model!r}, or set "
                   "train.static_graph: false")
            said = re.split(r"(?<=\.) (?=[A-Z])", str(e).splitlines()[0])[0]  # torch's first sentence
            raise ConfigError(f"train.static_graph: DDP's static_graph is on ({self.static_why}), but the "
                              f"parameters the model used changed between steps, noticed in step {self.step + 1} "
                              f"(torch: {said}); {fix}") from None

    def optimizer_step(self) -> float:
        """Clip, step the optimizer and the LR schedule, clear the gradients; the LR it used."""
        cfg = self.cfg
        self.recorder.beat("optimizer")
        if cfg.grad_clip is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        if step_optimizer(self.optimizer, self.scaler):
            self.scheduler.step()  # not on a step the GradScaler skipped
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return lr

    def maybe_checkpoint(self) -> None:
        if self.step % self.job.checkpoint.every_steps == 0:
            self.save()  # checkpoint time counts against throughput

    def handle_stop(self) -> bool:
        """This step boundary's stop vote (all ranks stop at the same step): True to stop now."""
        self.recorder.beat("vote")
        if not stop_here(self.vote, self.stop, self.step):
            return False
        self.session.stopped = True
        self.recorder.ledger.enter("stop")
        return True

    def end_epoch(self, exhausted: bool) -> None:
        """After `train_epoch`: drop a partial accumulation; at the epoch's end, evaluate (when
        due) and move on to the next epoch."""
        if self.micro % self.accum:  # an iterable epoch ended inside an accumulation: drop it
            self.optimizer.zero_grad(set_to_none=True)
            self.session.step_loss = None
        if exhausted or (self.micro_per_epoch is not None and self.micro >= self.micro_per_epoch):
            self.maybe_evaluate()
            self.epoch, self.micro = self.epoch + 1, 0

    def maybe_evaluate(self) -> None:
        """The evaluation after this epoch, every `train.eval_every_epochs`; the last epoch's
        comes after the final checkpoint (`final_evaluation`)."""
        s, cfg = self.session, self.cfg
        if not (cfg.eval_every_epochs and (self.epoch + 1) % cfg.eval_every_epochs == 0 and not s.stopped
                and self.step < self.total_steps and self.epoch + 1 < cfg.epochs):
            return
        self.recorder.flush()
        with self.recorder.paused_for("eval", "eval"):
            s.last_eval = self.evaluate()
        s.last_eval_step = self.step
        self.recorder.evaluated(self.step, self.epoch, s.last_eval, say=True)

    # -- the end of a run ---------------------------------------------------------------
    def end_loop(self) -> None:
        """Close the throughput window, flush the metrics, settle the last stop vote."""
        self.recorder.end_session(self.sync)
        self.vote.close()
        if not self.session.stopped:
            self.recorder.ledger.enter("finish")

    def final_checkpoint(self) -> None:
        """The last step saved and complete on every rank; after a stop, `DDPKIT_STOP_FILE`
        tells `trainer.launch` so (it then exits `EXIT_STOPPED`)."""
        if self.last_saved != self.step:
            self.save(final=True)
        else:
            self.finish_saves()
        if self.session.stopped and os.environ.get(STOP_FILE_VAR):
            # the save (or finish_saves) returned after its barrier: complete on every rank.
            Path(os.environ[STOP_FILE_VAR]).write_text(f"{self.step}\n")

    def report_stop(self) -> None:
        signame = signal.Signals(self.stop.signum).name if self.stop.signum else STOP_AT_STEP_VAR
        if self.is_main:
            log.warning("stop requested (%s): checkpoint at step %d written; exiting %d",
                        signame, self.step, EXIT_STOPPED)

    def final_evaluation(self) -> None:
        """A completed run's evaluation, unless the last epoch's already covered this step."""
        s = self.session
        if self.cfg.eval_every_epochs and s.last_eval_step != self.step:
            with self.recorder.paused_for("eval", "eval"):
                s.last_eval = self.evaluate()
            epoch = self.epoch - 1 if self.micro == 0 and self.epoch > 0 else self.epoch
            self.recorder.evaluated(self.step, epoch, s.last_eval)

    def summary(self, status: str) -> dict[str, Any]:
        """The `ddpkit-summary` record. Every rank leaves a checksum file; the summary lists
        ranks, hosts and checksums. Parameters are what DDP keeps equal; buffers are compared
        only where it does too (BatchNorm running statistics are rank-local unless they are
        SyncBatchNorm's)."""
        s, r = self.session, self.recorder
        sha, buffers = params_sha256(self.model), buffers_sha256(self.model)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / f"params-rank{self.rank}.sha256").write_text(sha + "\n")
        # first/final loss: mean over the first/last k steps of this session on every rank
        # (k = steps/5, 1..10), so "the loss went down" is not decided by one noisy batch.
        losses = r.losses
        k = max(1, min(10, len(losses) // 5))
        ends = (sum(losses[:k]) / k, sum(losses[-k:]) / k) if losses else None
        ranks = self.all_gather({"rank": self.rank, "hostname": socket.gethostname(), "params_sha256": sha,
                                 "buffers_sha256": buffers, "ends": ends})
        all_ends = [e for e in (rank.pop("ends") for rank in ranks) if e]  # no rank record keeps "ends"
        identical = all(rank["params_sha256"] == sha for rank in ranks)
        buffers_checked = buffers is not None and not rank_local_buffers(self.model)
        return {
            "summary": True,
            "status": status,
            "steps": self.step,
            "epochs_done": self.epoch,
            "session_steps": r.steps,
            "resumed_from_step": self.resumed_from,
            "world_size": self.world,
            "global_batch": r.global_batch,
            "samples_per_s": r.samples_per_s(),
            "first_loss": sum(e[0] for e in all_ends) / len(all_ends) if all_ends else None,
            "final_loss": sum(e[1] for e in all_ends) / len(all_ends) if all_ends else None,
            "loss_window_steps": k if losses else None,
            **(s.last_eval or {}),
            "wall_s": time.time() - self.t0,
            "first_step_s": r.first_step_s,
            "launch_marks": r.launch_marks(),
            "device": str(self.device),
            "threads_per_rank": self.torch.get_num_threads(),
            "hostnames": sorted({rank["hostname"] for rank in ranks}),
            "ranks": ranks,
            "final_params_sha256": sha if identical else None,
            "params_identical": identical,
            # null: no buffers, or rank-local BatchNorm statistics
            "buffers_identical": all(rank["buffers_sha256"] == buffers for rank in ranks) if buffers_checked else None,
            "run_dir": str(self.run_dir),
            "checkpoint_dir": str(self.ckpt_dir),
            "straggler": r.stragglers.last_named,
            "own_s_per_rank": r.own_s_per_rank(),
        }

    def publish(self, summary: dict[str, Any], status: str) -> None:
        """Rank 0: the summary in metrics.jsonl and on stdout; a completed run's FINISHED
        marker and plot."""
        if not self.is_main:
            return
        self.recorder.publish(summary, self.step, self.epoch, status)
        if status != "completed":
            return
        from trainer import checkpoint

        # Last: after the final checkpoint, the evaluation and the summary, so a run that
        # dies before here is not taken for finished by a restart.
        checkpoint.write_finished(self.ckpt_dir, self.step)
        if self.cfg.plot:
            try:
                from trainer.plot import plot_run

                log.info("plot %s", plot_run(self.run_dir))
            except Exception as e:  # a plot must never fail a finished training run
                log.warning("could not write the plot: %s", e)


def torch_threads(threads: int | None, env: Any, local_world_size: int) -> int:
    """`train.threads`, else `OMP_NUM_THREADS` (the user's, or what trainer.launch derived
    from the CPUs the job got: see `trainer.launch.plan.threads_per_rank`), else this process's
    CPUs shared by the local ranks (a trainer started by hand)."""
    if threads:
        return threads
    omp = (env.get("OMP_NUM_THREADS") or "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_world_size))


def deterministic_algorithms(torch: Any) -> str:
    """`train.deterministic`: only deterministic kernels from here on (before the first cuBLAS
    call, which reads CUBLAS_WORKSPACE_CONFIG); what was set, in words. A job's own
    CUBLAS_WORKSPACE_CONFIG wins."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    return (f"torch.use_deterministic_algorithms(True), cudnn.benchmark off, "
            f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}")


#: The worker's trainer once it exists: where an uncaught exception happened (`main`).
CURRENT: dict[str, Trainer] = {}


def run(job: Any, denv: Any, t0: float) -> int:
    t_start = time.time()
    import torch

    t_torch = time.time()

    from trainer.dist import pick_device, process_group

    cfg = job.train
    torch.set_num_threads(torch_threads(cfg.threads, os.environ, denv.local_world_size))
    device = pick_device(denv, cfg.device, job.gpus_per_node)
    if cfg.deterministic:
        log.info("deterministic: %s", deterministic_algorithms(torch))
    if device.type == "cpu":  # CPU (gloo) runs only; before gloo and torch start their threads
        from trainer import host

        host.tune_rank(cfg, denv.local_rank, denv.local_world_size, torch.get_num_threads())
    stop = StopRequest()
    stop.install()
    # Launch marks (seconds since DDPKIT_LAUNCH_T0 in the summary's `launch_marks`): where the
    # time to the first step goes, node shim and torchrun included.
    marks = {"worker started": worker_t0(), "job read": t_start, "torch imported": t_torch}
    if FORKED:  # forked from the node's template (trainer/warm.py): torch was imported there
        marks = {"worker started": worker_t0(), "forked": FORKED["forked"], **marks}
    if os.environ.get(TORCHRUN_T0_VAR):
        marks = {"torchrun started": float(os.environ[TORCHRUN_T0_VAR]), **marks}
    # The attempt's ledger: from the launch (a restart by torchrun: from this worker's start),
    # `startup` until torch is imported, then the rendezvous, then setup.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    ledger = Ledger(worker_t0() if restarted else t0)
    ledger.enter("rendezvous", at=t_torch)
    with process_group(denv, device, cfg.timeout_s):
        marks["process group"] = time.time()
        ledger.enter("setup", at=marks["process group"])
        trainer = CURRENT["trainer"] = Trainer(job, denv, device, stop, t0, ledger)
        trainer.recorder.marks = {**marks, **trainer.recorder.marks}
        if trainer.already_finished():
            return EXIT_OK
        trainer.setup()
        return trainer.train()


def record_failure(job: Any, denv: Any, exc: BaseException) -> None:
    """The worker's exception in the run directory, for `ddpkit why` (trainer/attempts.py)."""
    trainer = CURRENT.get("trainer")
    attempts.record_exception(run_directory(job.train, job.name), denv.rank, exc,
                              step=getattr(trainer, "step", None), phase=trainer.recorder.hb.phase if trainer else None)


def main() -> int:
    t0 = float(os.environ.get(LAUNCH_T0_VAR) or time.time())
    from pydantic import ValidationError

    from trainer.config import ConfigError, error_line, load_job_sections
    from trainer.dist import read_dist_env

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING, stream=sys.stdout,
        format=f"%(asctime)s ddpkit rank {rank} %(levelname)s %(message)s", datefmt="%H:%M:%S",
    )
    try:
        job = load_job_sections()
        denv = read_dist_env()
    except ValidationError as e:
        say(f"bad job file: {error_line(e)}")
        return EXIT_BAD_CONFIG
    except (OSError, ValueError) as e:  # the job file or the worker variables (DistEnvError)
        say(str(e))
        return EXIT_BAD_CONFIG
    try:
        return run(job, denv, t0)
    except ConfigError as e:  # a bad setting found while building the workload: no traceback
        record_failure(job, denv, e)
        say(str(e))
        return EXIT_BAD_CONFIG
    except Exception as e:  # for `ddpkit why`, then as below
        record_failure(job, denv, e)
        raise
    # Anything else is a failure of the run: it propagates (traceback, exit 1) through
    # `entry`'s @record, which writes torchrun's error file so its failure summary names it.


def torchrun_error_handler() -> Any:
    """torchrun's error handler (its `@record` writes the error file), except that an exception
    that only says a peer went away is dated later (attempts.py `postdate_error_file`), so
    torchrun names the rank that died rather than its peer."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from trainer.attempts import CONSEQUENCE_LATER_S, PEER_GONE, postdate_error_file

    class ConsequenceLast(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            super().record_exception(e)
            if PEER_GONE.search(f"{type(e).__name__}: {e}"):
                postdate_error_file(self._get_error_file_path(), CONSEQUENCE_LATER_S)

    return ConsequenceLast()


def entry() -> None:
    """`python -m trainer.train` / `python -m trainer`: main() under torchrun's `@record`."""
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main, torchrun_error_handler())())


if __name__ == "__main__":
    entry()
