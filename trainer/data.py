"""Built-in synthetic data sets and the per-epoch batch sampler that makes resume exact."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, DistributedSampler
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
    """
    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (CNN_TRAIN_SAMPLES,), generator=g)
    x = torch.randn(CNN_TRAIN_SAMPLES, 3, 32, 32, generator=g) + 0.5 * templates[y]
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


class EpochBatches:
    """Batch sampler over one rank's `DistributedSampler` shard, able to skip a prefix.

    `start(epoch, skip)` selects the epoch (the sampler's shuffle seed) and how many batches
    of it were already consumed before a checkpoint; iterating then yields the remaining
    batches, so a resumed run sees exactly the batches an uninterrupted run would have.
    The last batch of an epoch may be short, as with a DataLoader's `drop_last=False`.
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size
        self.skip = 0

    def start(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.skip = skip

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        indices = list(self.sampler)
        for b in range(self.skip, len(self)):
            yield indices[b * self.batch_size : (b + 1) * self.batch_size]
