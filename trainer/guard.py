"""Stacks and a verdict for your own torchrun script (`script:` or `module:` jobs), which has no
heartbeats for the hang watchdog: `python -m trainer.guard SCRIPT ARGS` (or `-m MODULE ARGS`)
runs the script as `python SCRIPT ARGS` would (as `__main__`, its folder first on `sys.path`),
after two hooks, stdlib only:

- a stop signal (SIGTERM or SIGINT: torchrun ending the group after a rank failed, or a stop reaching the
  workers) writes the rank's Python stacks, every thread (`faulthandler`, chained: the signal
  then does what it did before), to `RUN_DIR/debug/attempt-N/rank-R.txt`;
- an uncaught exception writes the same file (its traceback first) and the exception record
  `ddpkit why` reads (trainer/attempts.py `record_exception`), then Python prints it as always.

The launcher (trainer/launch/) runs every worker of a script job this way, and after torchrun
ended with a failure it calls `write_verdict`: when a rank's exception is a collective timeout
(or the launcher was stopped), the stacks say which rank waited in a collective and which was
elsewhere, the one that held the others up: `verdict.txt` beside the stacks, and a
`ddpkit-hang {json}` line, as the watchdog writes them. A rank that left no stacks at all
(SIGSTOPped, SIGKILLed) is named for that. `RUN_DIR` comes from `DDPKIT_RUN_DIR`; without it
the script runs unguarded.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from trainer import integrations, rank_lines, script_steps, script_watch
from trainer.attempts import ATTEMPTS_DIR, ERRORS_DIR, read_records, record_exception
from trainer.contract import HANG_VERDICT_PREFIX, RUN_DIR_VAR

PREFIX = HANG_VERDICT_PREFIX
#: The signals a stop reaches a worker with (torchrun passes on the one it got: Ctrl-C's SIGINT).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How gloo, NCCL and c10d say a collective (or the store) timed out.
_TIMEOUT = re.compile(r"[Tt]imed out|[Tt]imeout|Watchdog caught collective operation timeout|DistTimeoutError")
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')


def debug_dir(run_dir: Path, attempt: int) -> Path:
    return run_dir / "debug" / f"attempt-{attempt}"


def _header(rank: int, attempt: int, why: str) -> str:
    return (f"rank {rank} on {socket.gethostname()} (pid {os.getpid()}), attempt {attempt}, {why}; "
            f"main thread 0x{threading.main_thread().ident or 0:016x}\n\n")


def install(run_dir: Path) -> IO[str] | None:
    """The two hooks (module docstring), for this worker; the open stacks file."""
    rank = int(os.environ.get("RANK", "0") or 0)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    where = debug_dir(run_dir, attempt)
    try:
        where.mkdir(parents=True, exist_ok=True)
        stacks = open(where / f"rank-{rank}.txt", "w")  # noqa: SIM115  (kept open: the signal handler writes to it)
        stacks.write(_header(rank, attempt, "stacks at a stop signal (most recent call first)"))
        stacks.flush()
    except OSError as e:
        print(f"ddpkit guard: no stacks for rank {rank}: {e}", file=sys.stderr)
        return None
    for stop in STOP_SIGNALS:
        faulthandler.register(stop, file=stacks, all_threads=True, chain=True)
    keep_stacks_at_stop_signals(stacks)
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        with contextlib.suppress(Exception):
            unregister_stop_signals()
            stacks.seek(0)
            stacks.truncate()
            stacks.write(_header(rank, attempt, f"an uncaught {kind.__name__}"))
            stacks.write("".join(traceback.format_exception(kind, exc, tb)) + "\n")
            stacks.flush()
            faulthandler.dump_traceback(stacks, all_threads=True)
            stacks.flush()
        record_exception(run_dir, rank, exc, step=None, phase=None)
        previous(kind, exc, tb)

    sys.excepthook = hook
    return stacks


def unregister_stop_signals() -> None:
    for stop in STOP_SIGNALS:
        faulthandler.unregister(stop)


def keep_stacks_at_stop_signals(stacks: IO[str]) -> None:
    """A script (or its framework: Lightning) that sets its own SIGTERM or SIGINT handler would
    replace the stacks dump: `signal.signal` for them installs the handler, then the dump again in front
    of it (the dump runs first, in the signal, even while the main thread is blocked in C++;
    the script's handler then runs as it would have)."""
    original = signal.signal

    def signal_keeping_stacks(signum: Any, handler: Any) -> Any:
        if signum not in STOP_SIGNALS or stacks.closed:
            return original(signum, handler)
        previous = signal.getsignal(signum)
        faulthandler.unregister(signum)
        original(signum, handler)
        faulthandler.register(signum, file=stacks, all_threads=True, chain=True)
        return previous

    signal.signal = signal_keeping_stacks


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m trainer.guard SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    from trainer.config import load_job_sections

    if rank_lines.wanted(os.environ):  # first: the relay is forked before anything else is open
        rank_lines.start(int(os.environ.get("RANK", "0") or 0))
    run_dir = Path(os.environ[RUN_DIR_VAR]) if os.environ.get(RUN_DIR_VAR) else None
    stacks = install(run_dir) if run_dir is not None else None
    job = load_job_sections()
    steps = script_steps.from_environment(run_dir, int(os.environ.get("RANK", "0") or 0), job)
    if stacks is not None and job.train.watchdog:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        steps.heartbeat = script_watch.start(
            stacks, attempt=attempt, debug_dir=debug_dir(run_dir, attempt), floor_s=job.train.hang_floor_s,
            factor=job.train.hang_factor, timeout_s=job.train.timeout_s, on_hang=steps.hung,
            on_windows=steps.compare)
    steps.install()
    integrations.install(steps)
    if job.local_rank_arg:  # first, before the script's own arguments, as torch.distributed.launch put it
        at = 2 if argv[0] == "-m" else 1
        argv = [*argv[:at], f"{job.local_rank_arg}={os.environ.get('LOCAL_RANK', '0')}", *argv[at:]]
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = argv
            sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it (here: the guard's folder)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    steps.finish("completed")
    leave_finished()


def leave_finished() -> None:
    """The script finished: exit 0 as the interpreter would (non-daemon threads joined, atexit
    handlers run, streams flushed), then `os._exit`, as a warm worker does (trainer/forked.py).
    Skipped: the interpreter's finalization and C++ static destructors, where a finished
    rank's exit can still abort (CI once saw `terminate called without an active exception`,
    SIGABRT, after a gloo script's last line and its `destroy_process_group`), which would
    fail a run whose every rank had finished."""
    from trainer.forked import finish_like_exit

    finish_like_exit()
    os._exit(0)


# -- the launcher's side: a verdict from the stacks -----------------------------------------------

def _main_stack(text: str) -> list[tuple[str, int, str]]:
    """The main thread's frames (file, line, function), innermost first, from a stacks file:
    an exception's traceback where there is one (the dump after it shows only the hook), else
    faulthandler's block of the main thread."""
    lines = text.splitlines()
    if "Traceback (most recent call last):" in text:
        frames = []
        for line in lines:
            found = re.match(r'^\s*File "(.+)", line (\d+), in (\S+)', line)
            if found:
                frames.insert(0, (found.group(1), int(found.group(2)), found.group(3)))
        return frames
    ident = re.search(r"main thread (0x[0-9a-f]+)", text)
    start = next((i for i, line in enumerate(lines)
                  if ident and line.split(" (")[0].endswith(ident.group(1))), None)
    frames = []
    for line in lines[start + 1:] if start is not None else []:
        found = _FRAME.match(line)
        if not found:
            break
        frames.append((found.group(1), int(found.group(2)), found.group(3)))
    return frames


def write_verdict(run_dir: Path, world: int, stopped: str | None = None) -> dict[str, Any] | None:
    """After torchrun ended with a failure (or was stopped: `stopped` names the signal): for each
    attempt with stacks and no verdict yet, the verdict when a rank's exception is a collective
    timeout or the stop came from outside. A timeout wins over a stop: on Slurm a node whose
    ranks timed out first ends its task, and srun then stops node 0's launcher, whose stop is
    the timeout's consequence. None when there is nothing to say."""
    errors = read_records(run_dir / ATTEMPTS_DIR / ERRORS_DIR)
    found = None
    for directory in sorted((run_dir / "debug").glob("attempt-*")):
        if (directory / "verdict.txt").exists():
            continue
        attempt = int(directory.name.split("-", 1)[1])
        mine = [e for e in errors if int(e.get("restart", 0)) == attempt]
        timed_out = [e for e in mine if _TIMEOUT.search(f"{e.get('type')}: {e.get('message')}")]
        if not timed_out and not stopped:
            continue
        places = {}
        for r in range(world):
            path = directory / f"rank-{r}.txt"
            text = path.read_text(errors="replace") if path.exists() else ""
            if 'File "' in text:
                waits, said = script_watch.where_is(_main_stack(text))
                host = re.match(r"rank \d+ on (\S+)", text)
                places[r] = (waits, f"on {host.group(1)} at {said}" if host else said)
            else:
                places[r] = None
        waiting = sorted(r for r, p in places.items() if p and p[0])
        elsewhere = sorted(r for r, p in places.items() if p and not p[0])
        silent = sorted(r for r, p in places.items() if p is None)
        parts = [f"rank {r}: {places[r][1]}" for r in elsewhere]
        parts += [f"rank {r}: no stacks (frozen or killed: SIGSTOP, SIGKILL, a node gone)" for r in silent]
        others = ", ".join(f"rank {r}: {places[r][1]}" for r in waiting) or "none"
        if stopped and not timed_out:  # a stop after a timeout (srun ending the other nodes) is its echo
            cause, culprits = "stopped", []
            explain = f"stopped by {stopped}; where each rank was: " + "; ".join(
                [f"rank {r}: {p[1]}" if p else f"rank {r}: no stacks" for r, p in sorted(places.items())])
        else:
            e = timed_out[0]
            cause, culprits = "collective-timeout", (elsewhere + silent) or waiting
            explain = (f"collective timeout on rank {e.get('rank')} ({e.get('type')}: "
                       f"{str(e.get('message')).splitlines()[0][:200]}); "
                       + ("; ".join(parts) if parts else "every rank waited in a collective (a deadlock)"))
        found = {"attempt": attempt, "reporter": "launcher", "cause": cause, "culprits": culprits,
                 "explain": explain, "others": others, "debug_dir": str(directory), "time": time.time()}
        with contextlib.suppress(OSError):
            (directory / "verdict.txt").write_text(json.dumps(found, indent=1) + "\n")
        print(PREFIX + json.dumps(found), file=sys.stderr, flush=True)
    return found


if __name__ == "__main__":
    main(sys.argv[1:])
