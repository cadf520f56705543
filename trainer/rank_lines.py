"""Each line a script job's worker prints starts with its global rank, `[rankR]: ` (torch's own
prefix on an uncaught exception in a process group; `torchrun --tee` users know the look), on
every target: the terminal, a pod's log, the Slurm job's file. `ddpkit logs --worker-rank R`
and the launcher's `[NODE/RANK]` tags (trainer/launch/relay.py, where nodes share one file)
read the rank from it, with no change to the script. The built-in trainer's lines name their
rank already.

`start` routes the worker's stdout and stderr (file descriptors 1 and 2, so also what its
libraries and child processes write) through a relay process forked before the script starts:
it writes whole lines, each with the prefix, to the streams the worker had, and ends when the
last writer closed them (it ignores the stop signals, so the last lines after a stop still come).
Why a process and not torchrun's `--tee`: torchrun's tailer reads files every 0.1 s, so a rank's
stdout and stderr lose their relative order and its lines come late; here each stream keeps its
order, and a line goes out as soon as its newline came. A line ended by a carriage return (a
progress bar redrawing itself) goes out at once too. Where stdout was a terminal, the worker's
`sys.stdout` stays line-buffered. A job with one rank, or with `DDPKIT_RANK_LINES=0` in its env,
is left as it is.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
from collections.abc import Callable

from trainer import contract

#: The relay's process name (/proc/PID/comm): it shares its worker's environment (a fork), so
#: the launcher's search for a node's ranks by environment (trainer/launch/script_stop.py)
#: tells it apart by this name.
RELAY_NAME = "ddpkit-lines"
#: A line as the relay cuts it: its text, and the newline or carriage return that ends it.
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def wanted(env: dict[str, str] | os._Environ) -> bool:
    return int(env.get("WORLD_SIZE", "1") or 1) > 1 and env.get(contract.RANK_LINES_VAR, "1") != "0"


def start(rank: int) -> int:
    """Route fds 1 and 2 through a relay that starts each line with `[rankR]:`; its pid."""
    tty = os.isatty(1)
    prefix = contract.WORKER_LINE_PREFIX.format(rank=rank).encode()
    pid = fork_relay(lambda streams: relay(streams, prefix), name=RELAY_NAME)
    if tty:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    return pid


def fork_relay(copy: Callable[[dict[int, int]], None], name: str | None = None) -> int:
    """Route this process's stdout and stderr (fds 1 and 2), and so those of every process it
    starts, through a forked process that runs `copy({read end: the fd it was})`; its pid.
    The relay (named `name`, if given) ignores the stop signals and exits when `copy` returns:
    when the last writer closed the streams, so the last lines after a stop still come."""
    sys.stdout.flush()
    sys.stderr.flush()
    pipes = {fd: os.pipe() for fd in (1, 2)}
    pid = os.fork()
    if pid == 0:  # the relay
        try:
            if name:
                with open("/proc/self/comm", "w") as comm:
                    comm.write(name)
            for signal_name in contract.TORCHRUN_SIGNALS:
                signal.signal(getattr(signal, signal_name), signal.SIG_IGN)
            for _, write_end in pipes.values():
                os.close(write_end)
            copy({read_end: fd for fd, (read_end, _) in pipes.items()})
        finally:
            os._exit(0)
    for fd, (read_end, write_end) in pipes.items():
        os.close(read_end)
        os.dup2(write_end, fd)
        os.close(write_end)
    return pid


def relay(streams: dict[int, int], prefix: bytes) -> None:
    """Copy each read end in `streams` to its write end, line by line with `prefix`, until
    every one reached its end."""
    pending = dict.fromkeys(streams, b"")
    while pending:
        ready, _, _ = select.select(list(pending), [], [])
        for read_end in ready:
            try:
                data = os.read(read_end, 65536)
            except InterruptedError:
                continue
            out = streams[read_end]
            if not data:  # every writer closed it: the rest, as a line
                rest = pending.pop(read_end)
                if rest:
                    write_all(out, prefixed(rest + b"\n", prefix))
                continue
            text = pending[read_end] + data
            # a carriage return at the very end may be the first half of a \r\n: it waits
            cut = max(text.rfind(b"\n"), text.rfind(b"\r", 0, len(text) - 1)) + 1
            if cut:
                write_all(out, prefixed(text[:cut], prefix))
            pending[read_end] = text[cut:]


def prefixed(lines: bytes, prefix: bytes) -> bytes:
    """Whole lines, each started with `prefix` unless it has it already (torch prints it on an
    uncaught exception in a process group)."""
    own = prefix.rstrip()
    return b"".join(line if line.startswith(own) else prefix + line for line in _LINE.findall(lines))


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data`, unless the reader is gone."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:  # the reader is gone: nothing more to do
            return
