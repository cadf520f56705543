"""Whole, tagged lines: where a context's nodes share one output file (Slurm writes every
node's lines into the job's one file), the launcher routes its streams, and so those of every
process it starts, through a relay process that starts each whole line with its node and rank
(`contract.node_line_tag`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from trainer import contract
from trainer.rank_lines import fork_relay, write_all

#: Contexts whose nodes share one output file: their lines carry contract.NODE_LINE_TAG
#: (any context does with DDPKIT_LINE_TAGS=1: `ddpkit run --local` keeps RUN_DIR/output.log).
TAGGED_CONTEXTS = ("slurm", "slurm-srun")
#: How long the launcher waits, after its child ended, for the relay to write the last lines.
RELAY_DRAIN_S = 10.0


def tag_lines(data: bytes, node: int, rank: int | None) -> bytes:
    """`data` (whole lines) with each line started by its tag (contract.node_line_tag): `rank`
    where the launcher knows it (srun mode), else the rank the line names, else `-`."""
    out = []
    for line in data.splitlines(keepends=True):
        named = rank if rank is not None else contract.line_worker_rank(line.decode("utf-8", "replace"))
        out.append(contract.node_line_tag(node, named).encode() + line)
    return b"".join(out)


def relay(read_fd: int, write_fd: int, node: int, rank: int | None) -> None:
    """Copy whole lines from `read_fd` to `write_fd`, each tagged, until end of file.

    A line is written only once its newline came (or the stream ended): a long line that the
    writer wrote in pieces comes out as one line, with one tag."""
    pending = b""
    while True:
        try:
            data = os.read(read_fd, 65536)
        except InterruptedError:
            continue
        if not data:
            break
        pending += data
        cut = pending.rfind(b"\n") + 1
        if cut:
            write_all(write_fd, tag_lines(pending[:cut], node, rank))
            pending = pending[cut:]
    if pending:
        write_all(write_fd, tag_lines(pending + b"\n", node, rank))


def start_relay(node: int, rank: int | None) -> int:
    """Route this process's stdout and stderr, and so those of every process it starts,
    through a relay process that tags each whole line (`relay`, a thread per stream); the
    relay's pid (trainer/rank_lines.py `fork_relay`: it ignores the stop signals, as Slurm
    signals every process of a step, and ends when the last writer closed the streams, so the
    workers' last lines after a stop still come)."""

    def copy(streams: dict[int, int]) -> None:
        threads = [threading.Thread(target=relay, args=(read_end, fd, node, rank), daemon=True)
                   for read_end, fd in streams.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    return fork_relay(copy)


def end_relay(pid: int, timeout_s: float = RELAY_DRAIN_S) -> None:
    """Close this process's ends of the relay's streams and give it `timeout_s` to write the
    rest (a worker's orphan that still holds a stream would keep it open for ever)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        time.sleep(0.05)
