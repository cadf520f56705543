"""What a warm restart's worker shares with the rest of the trainer: whether the node's template
process forked it (trainer/warm.py), and when it started. A leaf (standard library only): the
template writes here, the trainer and its records read here, and neither imports the other.
"""

from __future__ import annotations

import contextlib
import sys
import time

#: This module imported: the interpreter of a worker started cold is up (a launch mark).
_IMPORTED = time.time()

#: Set in a forked worker (trainer/warm.py `_child`): the template's, client's and torchrun
#: agent's pids, the client's start and the fork's time; the trainer records them (launch marks,
#: progress record). Empty in a worker started cold.
FORKED: dict[str, float] = {}


def worker_t0() -> float:
    """When this worker started: a forked worker's client's start (the process torchrun
    started), else when this interpreter imported the trainer (a launch mark)."""
    return FORKED.get("client_t0", _IMPORTED)


def finish_like_exit() -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run atexit, flush."""
    import atexit
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
