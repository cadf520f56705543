"""Small user workloads for tests/test_workloads.py, loaded by the trainer as
`tests.user_workloads:<function>` (the repository is on PYTHONPATH in those runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from trainer.models import Workload


def _blobs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()


class Numbered(IterableDataset):
    """An iterable of `n` (x, y) samples (its length is not known to the trainer)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        yield from zip(self.x, self.y, strict=True)


def iterable(cfg) -> Workload:
    """IterableDataset for training and evaluation; `model_args.samples` sets the size."""
    x, y = _blobs(int(cfg.model_args.get("samples", 203)))
    torch.manual_seed(0)
    return Workload(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                    Numbered(x[:-40], y[:-40]), Numbered(x[-40:], y[-40:]))


class Counting(nn.Module):
    """BatchNorm (rank-local running statistics) plus a buffer each rank bumps by rank+1 per
    training forward: with DDP's broadcast_buffers it restarts from rank 0's value each step."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
        self.register_buffer("bumps", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        if self.training:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.bumps += rank + 1
        return {"logits": self.net(x), "bumps": self.bumps.clone()}


def batchnorm(cfg) -> Workload:
    x, y = _blobs(512)
    torch.manual_seed(0)

    def loss(out, target):
        return F.cross_entropy(out["logits"], target)

    return Workload(Counting(), TensorDataset(x, y), TensorDataset(x[:64], y[:64]), loss_fn=loss,
                    accuracy=False, metrics=lambda out, batch: {"bumps": out["bumps"]})


def bad_loss(cfg) -> Workload:
    """A shape error in the loss: an error of the run, not of the job file."""
    x, y = _blobs(256)
    torch.manual_seed(0)

    def loss(out, target):
        raise ValueError(f"loss got logits {tuple(out.shape)} and targets {tuple(target.shape)}: shapes do not match")

    return Workload(nn.Linear(8, 2), TensorDataset(x, y), loss_fn=loss)


def failing_eval(cfg) -> Workload:
    x, y = _blobs(256)
    torch.manual_seed(0)

    def metric(out, batch):
        raise RuntimeError("the evaluation metric failed")

    return Workload(nn.Linear(8, 2), TensorDataset(x, y), TensorDataset(x[:32], y[:32]), metrics=metric)


class Augmented(Dataset):
    """Random augmentation (noise from the global torch RNG) in __getitem__."""

    def __init__(self):
        self.x, self.y = _blobs(384)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.3 * torch.randn(8), self.y[i]


def augmented(cfg) -> Workload:
    torch.manual_seed(0)
    return Workload(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), Augmented())


class _Hang:
    """Where `hang` stops a rank: `model_args` `rank`, `after` (forward calls or samples) and
    `marker` (a file: only the attempt that creates it hangs, so a restart trains on)."""

    def __init__(self, cfg, enabled: bool = True):
        import os

        args = cfg.model_args
        self.armed = enabled and int(os.environ.get("RANK", "0")) == int(args.get("rank", 1))
        self.after, self.marker, self.count = int(args.get("after", 10)), str(args["marker"]), 0
        self.stop = args.get("where") == "stop"

    def maybe_hang(self) -> None:
        import os
        import signal
        import time

        self.count += 1
        if self.armed and self.count > self.after and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if self.stop:
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)


class SleepyModel(nn.Module):
    def __init__(self, hang: _Hang):
        super().__init__()
        self.net, self.hang = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), hang

    def forward(self, x):
        if self.training:
            self.hang.maybe_hang()  # outside any collective: in the forward
        return self.net(x)


class SleepyData(Dataset):
    def __init__(self, x, y, hang: _Hang):
        self.x, self.y, self.hang = x, y, hang

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.hang.maybe_hang()  # in a DataLoader worker when train.num_workers > 0
        return self.x[i], self.y[i]


def hang(cfg) -> Workload:
    """A rank that stops once (the hang watchdog's tests): `model_args.where` is `forward`
    (sleeps in the model's forward), `data` (in the data set, i.e. a DataLoader worker) or
    `stop` (SIGSTOPs itself in the forward: frozen whole, as a rank whose GPU or host froze)."""
    x, y = _blobs(int(cfg.model_args.get("samples", 4096)))
    where = cfg.model_args.get("where", "forward")
    torch.manual_seed(0)
    model = SleepyModel(_Hang(cfg, enabled=where in ("forward", "stop")))
    data = SleepyData(x, y, _Hang(cfg)) if where == "data" else TensorDataset(x, y)
    return Workload(model, data)


class _Faulty(nn.Module):
    """`faulty`'s model: on rank `model_args.rank`, after `after` training forwards, `fault`:
    `raise` (a ValueError), `kill` (SIGKILL to itself), `exit` (os._exit(3)), `oom` (allocates until
    the OOM killer ends it) or `nan` (its output, hence its loss, NaN); with `marker`,
    only the attempt that creates the marker file faults (a restart then trains on)."""

    def __init__(self, args: dict):
        import os

        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.armed = int(os.environ.get("RANK", "0")) == int(args.get("rank", 1))
        self.after, self.fault, self.marker = int(args.get("after", 5)), args.get("fault", "raise"), args.get("marker")
        self.count = 0

    def forward(self, x):
        import os
        import signal

        self.count += self.training
        if self.armed and self.training and self.count > self.after:
            if self.marker is None or not os.path.exists(self.marker):
                if self.marker:
                    open(self.marker, "w").close()
                if self.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fault == "exit":
                    os._exit(3)
                if self.fault == "oom":  # allocate (and touch) until the OOM killer ends it
                    import time

                    hog = []
                    while True:
                        hog.append(torch.ones(16 * 2**20))  # 64 MiB
                        time.sleep(0.01)
                if self.fault == "nan":  # from here on: a non-finite loss on this rank
                    self.marker = self.marker or os.devnull
                    return self.net(x) * float("nan")
                raise ValueError(f"injected fault on rank {os.environ.get('RANK')} after {self.after} steps")
        return self.net(x)


def faulty(cfg) -> Workload:
    x, y = _blobs(2048)
    torch.manual_seed(0)
    return Workload(_Faulty(cfg.model_args), TensorDataset(x, y))


class Recorded(Dataset):
    """`n` blobs; every fetch appends its indices to `ids_dir/<pid>.txt` (one batch a line),
    so a test can count which samples a run, and each attempt of it, trained on."""

    def __init__(self, n: int, ids_dir: str):
        self.x, self.y = _blobs(n)
        self.ids_dir = ids_dir

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):
        import os

        with open(os.path.join(self.ids_dir, f"{os.getpid()}.txt"), "a") as f:
            f.write(" ".join(map(str, indices)) + "\n")
        return [self[i] for i in indices]


def recorded(cfg) -> Workload:
    """`model_args`: `samples`, `ids_dir`, `dropout` (the probability; random draws in forward)."""
    args = cfg.model_args
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(float(args.get("dropout", 0.0))), nn.Linear(32, 2))
    return Workload(model, Recorded(int(args["samples"]), str(args["ids_dir"])))


class Shortcut(nn.Module):
    """Uses its `extra` layer in the first `model_args.extra_steps` training forwards only: the
    set of parameters that get a gradient changes between steps (on every rank alike)."""

    def __init__(self, extra_steps: int):
        super().__init__()
        self.body, self.extra = nn.Linear(8, 2), nn.Linear(2, 2)
        self.extra_steps, self.calls = extra_steps, 0

    def forward(self, x):
        self.calls += self.training
        out = self.body(x)
        return self.extra(out) if self.calls <= self.extra_steps else out


def changing(cfg) -> Workload:
    """`Shortcut`; `model_args.declare: true` claims a static graph all the same."""
    x, y = _blobs(512)
    torch.manual_seed(0)
    return Workload(Shortcut(int(cfg.model_args.get("extra_steps", 2))), TensorDataset(x, y),
                    static_graph=bool(cfg.model_args.get("declare", False)))
