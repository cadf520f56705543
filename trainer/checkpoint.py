"""Atomic, verified checkpoints; resume from the newest valid one; the FINISHED marker.

A checkpoint is two files: `ckpt-<step>.pt` (a plain `torch.save` file, loadable by hand) and
`ckpt-<step>.pt.sha256`. Both are written to temporary names, fsynced and renamed, checksum
first, so a `.pt` name only ever appears complete. On resume a checkpoint whose checksum is
missing or wrong, or which does not load, is skipped with a warning and the previous one used:
a torch zip file does not notice a flipped byte in the middle by itself.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ddpkit.trainer")

NAME = re.compile(r"^ckpt-(\d+)\.pt$")
FINISHED = "FINISHED"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """`(step, path)` of every checkpoint file in `directory`, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), d / n) for n in os.listdir(d) if (m := NAME.match(n))]
    return sorted(found, reverse=True)


def save(directory: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as the checkpoint of `step` and delete all but the newest `keep`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = d / f"ckpt-{step:09d}.pt"
    _write_atomic(path.with_name(path.name + ".sha256"), (hashlib.sha256(data).hexdigest() + "\n").encode())
    _write_atomic(path, data)
    _fsync_dir(d)
    for _, old in checkpoints(d)[keep:]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return path


def verify(path: Path) -> str | None:
    """None when `path` matches its checksum file, else why not."""
    sums = path.with_name(path.name + ".sha256")
    try:
        want = sums.read_text().split()[0]
    except (OSError, IndexError):
        return "its .sha256 file is missing"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != want:
        return "checksum mismatch (corrupt or truncated)"
    return None


def load(path: Path) -> dict[str, Any]:
    # Our own file, checksum-verified: full unpickling is needed for the RNG states.
    return torch.load(path, map_location="cpu", weights_only=False)


def newest_valid(directory: str | Path) -> Path | None:
    """The newest checkpoint that verifies; each newer broken one is reported and skipped."""
    for step, path in checkpoints(directory):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("checkpoint %s (step %d) is unusable: %s; trying the previous one", path, step, problem)
    return None


def write_finished(directory: str | Path, step: int) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _write_atomic(d / FINISHED, (json.dumps({"step": step}) + "\n").encode())


def finished_step(directory: str | Path) -> int | None:
    """The step recorded in the FINISHED marker, or None when there is none."""
    try:
        return int(json.loads((Path(directory) / FINISHED).read_text())["step"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return 2**62  # an unreadable marker still means "finished"
