"""Atomic, verified checkpoints; resume from the newest valid one; the FINISHED marker.

A checkpoint is two files: `ckpt-<step>.pt` (a plain `torch.save` file, loadable by hand) and
`ckpt-<step>.pt.sha256`. Both are written to temporary names and fsynced, then published by
renaming, checksum first, so a `.pt` name only ever appears complete. A crash before the
renames leaves only temporary files (removed by the next save); a crash between the two renames
leaves a checksum without its `.pt`, which names no checkpoint. On resume a checkpoint whose
checksum is missing or wrong, or which does not load, is skipped with a warning naming it and
the previous one used: a torch zip file does not notice a flipped byte in the middle by itself.

Fault injection for tests (like `DDPKIT_STOP_AT_STEP`): `DDPKIT_FAULT_CRASH=STEP:POINT` kills
the saving process with SIGKILL at POINT (`before-publish`: both files written, nothing renamed;
`mid-publish`: checksum renamed, `.pt` not) of the save of STEP; `DDPKIT_FAULT_SAVE_DELAY_S=S`
makes every save take S seconds longer (before publishing).

`AsyncSaver` (`checkpoint.async_save: true`) does the same save in a background thread from a
copy of the state in host memory, so training blocks only for the copy.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from trainer.contract import FAULT_CRASH_VAR, FAULT_SAVE_DELAY_S_VAR

log = logging.getLogger("ddpkit.trainer")

NAME = re.compile(r"^ckpt-(\d+)\.pt$")
FINISHED = "FINISHED"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path: Path, data: bytes) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk says nothing of the file: name it (and its size)
        if e.filename is not None:
            raise
        raise OSError(e.errno, f"{e.strerror} (writing {len(data)} bytes)", str(tmp)) from e
    return tmp


def _write_atomic(path: Path, data: bytes) -> None:
    os.replace(_write_tmp(path, data), path)


def _fault(step: int, point: str) -> None:
    """Tests only: die here when DDPKIT_FAULT_CRASH says `STEP:POINT`."""
    if os.environ.get(FAULT_CRASH_VAR) == f"{step}:{point}":
        log.warning("%s: killing this process at %s of the checkpoint of step %d", FAULT_CRASH_VAR, point, step)
        os.kill(os.getpid(), signal.SIGKILL)


def remove_leftovers(directory: str | Path) -> None:
    """Temporary files of saves that never published, and checksums without their `.pt`."""
    d = Path(directory)
    if not d.is_dir():
        return
    for name in os.listdir(d):
        orphan = name.endswith(".pt.sha256") and not (d / name[: -len(".sha256")]).exists()
        if orphan or (name.startswith(".ckpt-") and ".tmp-" in name):
            (d / name).unlink(missing_ok=True)


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
    sums = path.with_name(path.name + ".sha256")
    remove_leftovers(d)
    tmp_data = _write_tmp(path, data)
    tmp_sums = _write_tmp(sums, (hashlib.sha256(data).hexdigest() + "\n").encode())
    if os.environ.get(FAULT_SAVE_DELAY_S_VAR):
        time.sleep(float(os.environ[FAULT_SAVE_DELAY_S_VAR]))
    _fault(step, "before-publish")
    os.replace(tmp_sums, sums)
    _fault(step, "mid-publish")
    os.replace(tmp_data, path)
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


def newest_valid(directory: str | Path, skipped: list[dict[str, Any]] | None = None) -> Path | None:
    """The newest checkpoint that verifies; each newer broken one is reported, skipped and
    appended to `skipped` (`{"path", "step", "problem"}`: `ddpkit why` says so)."""
    for step, path in checkpoints(directory):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("checkpoint %s (step %d) is unusable: %s; trying the previous one", path, step, problem)
        if skipped is not None:
            skipped.append({"path": str(path), "step": step, "problem": problem})
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


class AsyncSaver:
    """`checkpoint.async_save`: copy the state to host memory, write and publish it in the background.

    `submit()` blocks only while every tensor of the state is copied into host buffers (pinned
    and reused from save to save; on CUDA the copies are queued on the current stream and the
    writer thread waits for them), then a writer thread runs `save()` exactly as a synchronous
    save would: serialize, checksum, temporary files, fsync, rename. A crash or SIGKILL before
    the rename leaves the previous checkpoint the newest valid one. At most one save is in
    flight: the next `submit()`, `wait()` and `close()` first wait for the pending one, and a
    failed background write is raised there. The writer is not a daemon thread, so a process
    that exits normally (or with an exception) still completes the pending save.
    """

    def __init__(self) -> None:
        self.thread: Any = None
        self.error: BaseException | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.event: Any = None
        self.last_path: Path | None = None

    def _host(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self.buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        return buf

    def snapshot(self, obj: Any, key: str = "") -> Any:
        """`obj` with every tensor replaced by its copy in a host buffer (containers rebuilt)."""
        if isinstance(obj, torch.Tensor):
            return self._host(key, obj)
        if isinstance(obj, dict):
            items = [(k, self.snapshot(v, f"{key}/{k}")) for k, v in obj.items()]
            try:
                out = type(obj)(items)  # OrderedDict stays one (a state_dict)
            except TypeError:
                out = dict(items)
            if hasattr(obj, "_metadata"):  # a module state_dict's versions, as torch.save keeps them
                out._metadata = copy.deepcopy(obj._metadata)
            return out
        if isinstance(obj, list):
            return [self.snapshot(v, f"{key}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.snapshot(v, f"{key}/{i}") for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def submit(self, directory: str | Path, step: int, state: dict[str, Any], keep: int) -> None:
        self.wait()
        host = self.snapshot(state)
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record()
        self.thread = threading.Thread(target=self._write, args=(directory, step, host, keep),
                                       name=f"ddpkit-checkpoint-{step}", daemon=False)
        self.thread.start()

    def _write(self, directory: str | Path, step: int, host: dict[str, Any], keep: int) -> None:
        try:
            if self.event is not None:
                self.event.synchronize()
            self.last_path = save(directory, step, host, keep)
        except BaseException as e:  # raised in the training thread by wait()
            log.error("background checkpoint of step %d failed: %s", step, e)
            self.error = e

    def pending(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is published; raise if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"the background checkpoint write failed: {error}") from error
        return self.last_path
