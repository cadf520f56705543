"""Built-in synthetic data sets, the global batch sampler that makes resume exact at any world size, and the
batch plumbing for user workloads (iterable data sets, dict batches, models with their own loss)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

CNN_TRAIN_SAMPLES = 16384
CNN_EVAL_SAMPLES = 2048


class TensorPairs(Dataset):
    """In-memory `(x, y)` pairs that hand out whole batches with one index operation."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        assert len(x) == len(y)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]):
        # The DataLoader fetcher calls this with a whole batch: one gather, no per-sample stack.
        idx = torch.as_tensor(indices)
        return self.x[idx], self.y[idx]


def collate(data):
    """Batches from `__getitems__` are already collated; anything else goes to torch's default."""
    if isinstance(data, tuple):
        return data
    return default_collate(data)


def synthetic_images(samples: int | None = None, held_out: bool = True) -> tuple[TensorPairs, TensorPairs | None]:
    """The `cnn` data set, exactly: ten class templates plus Gaussian noise.

    Generated in this order from one generator seeded 1234 (so a plain loop can rebuild it):
    `T = randn(10,3,32,32)`, `y = randint(0,10,(16384,))`, `x = randn(16384,3,32,32) + 0.5*T[y]`;
    the held-out set continues the same generator (2048 samples).
    Without the held-out set only the first `samples` images are drawn: torch's CPU `randn`
    fills from the generator in order, so they are the full set's first rows bit for bit
    (tests/test_trainer.py checks it) at a fraction of the cost (every worker start pays it,
    and a restart is a worker start).
    """
    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (CNN_TRAIN_SAMPLES,), generator=g)
    n = CNN_TRAIN_SAMPLES if samples is None or held_out else min(samples, CNN_TRAIN_SAMPLES)
    y = y[:n]
    x = torch.randn(n, 3, 32, 32, generator=g) + 0.5 * templates[y]
    if samples is not None:
        x, y = x[:samples], y[:samples]
    if not held_out:  # skip generating what nobody evaluates (startup time)
        return TensorPairs(x, y), None
    y_eval = torch.randint(0, 10, (CNN_EVAL_SAMPLES,), generator=g)
    x_eval = torch.randn(CNN_EVAL_SAMPLES, 3, 32, 32, generator=g) + 0.5 * templates[y_eval]
    return TensorPairs(x, y), TensorPairs(x_eval, y_eval)


def synthetic_tokens(
    samples: int, seq_len: int, vocab: int, eval_samples: int = 256
) -> tuple[TensorPairs, TensorPairs]:
    """Token sequences from a fixed random Markov chain: learnable, so the loss goes down."""
    g = torch.Generator().manual_seed(1234)
    transition = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), dim=-1)
    total = samples + eval_samples
    seq = torch.empty(total, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (total,), generator=g)
    for t in range(seq_len):
        seq[:, t + 1] = torch.multinomial(transition[seq[:, t]], 1, generator=g).squeeze(1)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return TensorPairs(x[:samples], y[:samples]), TensorPairs(x[samples:], y[samples:])


class GlobalBatches:
    """This rank's micro-batches of an epoch, cut from one global order of the data set.

    The order of epoch e is the permutation `DistributedSampler` draws (`randperm(n)` from a
    generator seeded `seed + e`). Optimizer step k of the epoch trains on its positions
    `[k*G, (k+1)*G)`, G = `global_batch`, whatever the world size. A step's G positions are
    dealt into `chunks = G / micro` chunks, interleaved (chunk c holds step positions c,
    c + chunks, c + 2*chunks, ...), and rank r of W trains chunks r, r + W, r + 2W, ... as its
    micro-batches 0, 1, 2, ... With one micro-batch per step that is DistributedSampler's split
    exactly (rank r takes every W-th sample from r), so the trainer still equals the textbook
    loop. The data position is the step within the epoch (a global sample cursor of k x G):
    a run resumed on another number of ranks that keeps G trains on the same samples in every
    step, and one that also keeps `micro` on the same chunks. An epoch is `n // G` steps; the
    samples left over (fewer than G) are skipped, like `drop_last`.
    """

    def __init__(self, samples: int, seed: int, rank: int, world: int, micro: int, accum: int):
        self.samples, self.seed, self.rank, self.world = samples, seed, rank, world
        self.micro, self.accum = micro, accum
        self.global_batch = world * micro * accum
        self.chunks = world * accum
        self.epoch, self.skip = 0, 0

    @property
    def steps(self) -> int:
        """Optimizer steps in an epoch."""
        return self.samples // self.global_batch

    def start(self, epoch: int, skip: int = 0) -> None:
        """Iterate epoch `epoch` from this rank's micro-batch `skip` on."""
        self.epoch, self.skip = epoch, skip

    def __len__(self) -> int:  # this rank's micro-batches in a whole epoch
        return self.steps * self.accum

    def chunk(self, micro_index: int) -> tuple[int, int]:
        """(step in the epoch, chunk of that step) of this rank's micro-batch `micro_index`."""
        step, k = divmod(micro_index, self.accum)
        return step, k * self.world + self.rank

    def seed_of(self, micro_index: int, stream: int = 0) -> int:
        """The seed random draws for this micro-batch start from: a function of (seed, epoch,
        step, chunk), so the same chunk draws the same numbers at any world size. Stream 0
        is for fetching its samples, 1 for its forward and backward."""
        step, c = self.chunk(micro_index)
        return (batch_seed(self.seed, self.epoch, step, c) + stream) % 2**63

    def order(self) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.samples, generator=g)

    def __iter__(self):
        """The micro-batches' indices, each with its seed. The RNGs of the process iterating
        (the training process) are seeded before each is handed out: a DataLoader without
        workers fetches, and so augments, it next; workers seed themselves (WorkerSeeded)."""
        order = self.order()
        for m in range(self.skip, len(self)):
            step, c = self.chunk(m)
            first = step * self.global_batch
            seed_everything(self.seed_of(m))
            yield SeededIndices(order[first + c : first + self.global_batch : self.chunks].tolist(), self.seed_of(m))


def layout_for(global_batch: int, world: int, micro_max: int) -> tuple[int, int]:
    """(micro-batch, accumulation) that trains `global_batch` samples a step on `world` ranks:
    the largest micro-batch up to `micro_max` (the job's `batch_size`: what fits in memory)
    that divides each rank's share, the fewest accumulation steps with it. ValueError when
    `global_batch` does not split evenly over the ranks."""
    if global_batch % world:
        raise ValueError(f"a global batch of {global_batch} samples does not split evenly over {world} ranks")
    share = global_batch // world
    accum = next(a for a in range(1, share + 1) if share % a == 0 and share // a <= micro_max)
    return share // accum, accum


def batch_seed(seed: int, a: int, b: int, c: int) -> int:
    """A seed per (job seed, a, b, c), e.g. (epoch, step, chunk) of a micro-batch or (rank,
    epoch, worker) of an iterable shard's worker: the same on a resumed run."""
    return (((seed * 1_000_003 + a) * 1_000_003 + b) * 1_000_003 + c) % 2**63


def seed_everything(seed: int) -> None:
    """Seed torch (CPU, and the current CUDA device once CUDA is in use), `random` and numpy.
    Called before every micro-batch, so it sets the generators directly: `torch.manual_seed`
    also visits every accelerator backend (0.7 ms a call here, against 25 us for this)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


class SeededIndices(list):
    """One batch's indices, carrying the seed its samples are drawn with in a worker."""

    def __init__(self, indices: list[int], seed: int):
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self):  # sent to DataLoader workers by pickle
        return (SeededIndices, (list(self), self.seed))


class WorkerSeeded(Dataset):
    """A map-style data set whose samples a DataLoader worker draws after seeding its RNGs with
    the micro-batch's seed (`GlobalBatches.seed_of`): random augmentation in workers is then a
    function of (seed, epoch, step, chunk), so a resumed run sees exactly the batches an
    uninterrupted one would, whichever worker fetches them and at any world size that keeps
    the micro-batch. The main process reseeds the same way before each micro-batch's
    forward (`Trainer.forward_backward_step`)."""

    def __init__(self, data: Dataset):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]

    def __getitems__(self, indices: list[int]):
        if get_worker_info() is not None and isinstance(indices, SeededIndices):
            seed_everything(indices.seed)
        getitems = getattr(self.data, "__getitems__", None)
        return getitems(list(indices)) if getitems else [self.data[i] for i in indices]


class RankShard(IterableDataset):
    """Rank r of n and worker w of m of an `IterableDataset`: every (n*m)-th sample, starting
    at r*m + w. `set_epoch` is passed on; each worker seeds its RNGs per (seed, rank, epoch,
    worker) so random augmentation repeats on a resumed run."""

    def __init__(self, data: IterableDataset, rank: int, world: int, seed: int, sharded: bool = False):
        self.data, self.rank, self.world, self.seed, self.sharded = data, rank, world, seed, sharded
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if info is not None:
            seed_everything(batch_seed(self.seed, self.rank, self.epoch, worker))
        if self.sharded:
            yield from self.data
            return
        shards, me = self.world * workers, self.rank * workers + worker
        for i, sample in enumerate(self.data):
            if i % shards == me:
                yield sample


def is_iterable(data: Any) -> bool:
    return isinstance(data, IterableDataset)


# -- batches of any shape ---------------------------------------------------------------------


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format) -> Any:
    """Every tensor of a batch (tensor, tuple/list, dict, nested) on `device`; 4-D ones in
    `memory_format` (channels-last images)."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if batch.dim() == 4 and memory_format is not torch.contiguous_format:
            batch = batch.contiguous(memory_format=memory_format)
        return batch
    if isinstance(batch, Mapping):  # a dict, or e.g. a tokenizer's BatchEncoding: a dict then
        return {k: to_device(v, device, memory_format) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, memory_format) for v in batch)
    return batch


def split_batch(batch: Any, own_loss: bool, target_key: str = "labels") -> tuple[tuple, dict, Any]:
    """(positional inputs, keyword inputs, target) of a batch.

    A model with its own loss gets everything (labels included) and the target is only kept
    for counting; else the target is a tuple's last element or a dict's `target_key`.
    """
    if isinstance(batch, Mapping):
        if own_loss:
            return (), dict(batch), batch.get(target_key)
        if target_key not in batch:
            raise KeyError(f"the batch has no {target_key!r} (keys: {sorted(batch)}); set "
                           "Workload.target_key, or loss_fn=None for a model that computes its loss")
        return (), {k: v for k, v in batch.items() if k != target_key}, batch[target_key]
    if isinstance(batch, (list, tuple)):
        if own_loss:
            return tuple(batch), {}, None
        if len(batch) < 2:
            raise ValueError(f"a batch of {len(batch)} element(s) has no target; give (input, target)")
        return tuple(batch[:-1]), {}, batch[-1]
    if own_loss:
        return (batch,), {}, None
    raise ValueError(f"a {type(batch).__name__} batch has no target; give (input, target) or a dict")


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: `output.loss`, `output["loss"]`, `output[0]` or the
    output (a scalar tensor)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (list, tuple)) and output:
        loss = output[0]
    if loss is None:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the model has no loss in its output ({type(output).__name__}); return a "
                        "scalar loss, an object with .loss, or set Workload.loss_fn")
    return loss.reshape(())


def batch_samples(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = batch_samples(v)
        if n:
            return n
    return 0
