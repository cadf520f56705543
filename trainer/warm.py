"""Warm restarts: a node's template process imports torch and the trainer once and forks the
workers; torchrun starts a tiny client per worker instead of a fresh `python -m trainer.train`.

Why (bench/launch_time.py `--kills`, README "Faults, restarts and preflight"): a cold restart
of 2 local `cnn` ranks spent most of its time importing, not training. Medians of 6 kills on
the 2-core machine at load 2-3, seconds after the kill: the new workers' interpreters were up
at 0.6 (torchrun noticing, stopping the other rank, the next rendezvous round, Python's start),
`import torch` was done at 3.2, the process group at 3.7, the data set and model at 4.0, the
first optimizer (it imports `torch._dynamo`) at 6.0, the checkpoint and DDP at 6.3, the first
step at 6.4. 4.6 of those 6.4 s are imports that every attempt repeats: the template does them
once per node, and a restart costs a fork (1.06 s from the kill to the first step, median of 8,
against 11.1 s cold in the same run at load 3-6).

Two ways were weighed: a template that forks each worker (this module), and a resident worker
that survives its peer's death and re-forms its process group on a fresh store. The resident
worker would also keep the data set and model (0.5-0.8 s), but it replaces torchrun's restart
(every rank must notice the failure, leave its collectives, agree on a new store) and keeps
state that a crash may have left half-updated; bit-exact resume is only argued for a fresh
process that loads the checkpoint. A forked worker is such a fresh process: the template did no
tensor work (import only: no threads, no OpenMP pool, no process group; `serve` checks the
thread count), and each child resets what a fork would share (RNGs, signals, streams,
environment, working directory) before it runs the entry exactly as `python -m` would. (The
built-in workloads are made from fixed seeds, so the template builds the job's data set and
initial model once too, on one thread, and each worker takes its copy-on-write copy.)

The protocol, one unix-socket connection per worker (the socket lives in the launcher's
private temporary directory, `DDPKIT_WARM_SOCKET`):

    client -> template   one JSON request (argv, env, cwd, the client's start time), length
                         first, with the client's stdin, stdout and stderr (SCM_RIGHTS)
    template -> client   {"pid": N} once forked, then {"status": S} (os.waitpid's status);
                         or {"cold": WHY} from a template that may not fork (`_fork_unsafe`)

The client (`python -m trainer.warm ENTRY...`, standard library only, ~30 ms) is the worker
torchrun sees: it forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR2 to the forked worker
and ends as the worker ended (its exit code, or killed by the same signal), so torchrun's failure
reports, the stop exit codes (143/137) and `ddpkit why` read as before. If the client dies
(torchrun's SIGKILL after its shutdown timeout, a kill -9), the template sees the connection
close before it sent the status and SIGKILLs the worker. If the template dies, its workers get
SIGKILL (PR_SET_PDEATHSIG), and a client that finds no template starts the worker cold.

The template imports when the first client connects (`serve`), and ignores the stop signals (Slurm signals every process of a step; the workers get
theirs through their clients) and ends when the launcher closes its stdin or dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time

from trainer.contract import WARM_SOCKET_VAR

#: The signals a client passes on to its worker (those torchrun passes on to its workers: the
#: launcher's `--signals-to-handle`); the template ignores them.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)
#: How long a client waits for the template's socket to appear before it starts cold.
CONNECT_WAIT_S = 10.0
#: What the template imports once (the built-in trainer's imports, `torch._dynamo` included:
#: the first optimizer and DDP's constructor import it).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.optim",
           "torch.utils.data", "torch.distributed.elastic.multiprocessing.errors",
           "torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "numpy", "yaml", "pydantic", "tqdm",
           "trainer.config", "trainer.dist", "trainer.data", "trainer.models", "trainer.checkpoint",
           "trainer.train", "trainer.preflight")
#: torch's thread count before the template built the workload on one thread (a worker gets it back).
DEFAULT_THREADS: list[int] = []
#: Set in a forked worker (`_child`): the template's, client's and torchrun agent's pids, the
#: client's start and the fork's time; the trainer records them (launch marks, progress record).
FORKED: dict[str, float] = {}


# -- the wire ------------------------------------------------------------------------------------
def _send(sock: socket.socket, obj: object, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _recv(sock: socket.socket, want_fds: int = 0) -> tuple[object, list[int]] | None:
    """One framed message (and up to `want_fds` descriptors); None at end of stream."""
    if want_fds:
        data, fds, _, _ = socket.recv_fds(sock, 65536, want_fds)
    else:
        data, fds = sock.recv(65536), []
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = sock.recv(65536)
        if not more:
            return None
        data += more
    size = struct.unpack("!I", data[:4])[0]
    return json.loads(data[4:4 + size]), fds


# -- the client (what torchrun runs) -------------------------------------------------------------
def client(entry: list[str]) -> int:
    """Have the template fork the worker `entry` (what follows `python`), then be that worker
    for torchrun; without a template, exec the worker cold."""
    t0 = time.time()
    path = os.environ.get(WARM_SOCKET_VAR, "")
    sock = _connect(path) if path else None
    if sock is None:
        return _cold(entry, f"no template at {path or '(DDPKIT_WARM_SOCKET unset)'}")
    env = {k: v for k, v in os.environ.items() if k != WARM_SOCKET_VAR}
    try:
        _send(sock, {"argv": entry, "env": env, "cwd": os.getcwd(), "t0": t0, "pid": os.getpid(),
                     "ppid": os.getppid()}, [0, 1, 2])
        reply = _recv(sock)
    except OSError as e:
        reply, why = None, str(e)
    else:
        why = "it closed the connection"
    if reply is not None and "cold" in reply[0]:
        return _cold(entry, reply[0]["cold"])
    if reply is None or "pid" not in reply[0]:
        return _cold(entry, f"the template at {path} did not start the worker ({why})")
    pid = int(reply[0]["pid"])

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    while True:
        try:
            reply = _recv(sock)
            break
        except InterruptedError:
            continue
    if reply is None or "status" not in reply[0]:
        print(f"ddpkit warm: the template ended before worker {pid} did", file=sys.stderr, flush=True)
        return 1
    status = int(reply[0]["status"])
    if os.WIFSIGNALED(status):  # end as the worker did: torchrun reports the signal
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


def _connect(path: str) -> socket.socket | None:
    """A connection to the template; None when nobody listens within `CONNECT_WAIT_S` (the
    launcher binds the socket before the template's imports, so this wait is short)."""
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except FileNotFoundError:  # not bound yet
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        except OSError:  # refused: the template is gone
            sock.close()
            return None


def _cold(entry: list[str], why: str) -> int:
    print(f"ddpkit warm: {why}; starting the worker cold", file=sys.stderr, flush=True)
    os.environ.pop(WARM_SOCKET_VAR, None)
    os.execv(sys.executable, [sys.executable, *entry])
    return 1  # not reached


# -- the template --------------------------------------------------------------------------------
def serve(path: str, now: bool = False) -> int:
    """Listen on `path`; once the first client connects (`now`: at once), import `PRELOAD`;
    then fork a worker per request until stdin closes.

    The imports wait for the first client: until then the node starts as on the cold path
    (torchrun imports torch and joins the rendezvous alone; on a 2-core machine a template
    importing beside it made a second node miss an elastic group's 5-s last call), and the
    first attempt's workers wait for one import instead of each paying its own. A one-node job
    has no other node to wait for: the launcher passes `now`, and the template's imports run
    beside torchrun's own `import torch`: 2 local ranks of `cnn` took their first step 9.1 s
    after launch instead of 11.5 s (medians of 3 interleaved runs, load 2-4 on 2 cores,
    `bench/launch_time.py --baseline`; the textbook loop 11.2 s in the same run)."""
    import selectors

    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    with selectors.DefaultSelector() as first:
        first.register(listener, selectors.EVENT_READ, "accept")
        first.register(0, selectors.EVENT_READ, "stdin")
        while not now and not any(key.data == "accept" for key, _ in first.select()):
            if not os.read(0, 4096):  # the launcher is done before any worker was asked for
                return 0
    t = time.time()
    import importlib

    # numpy's OpenBLAS (torch imports numpy) starts a thread pool at import when it may use more
    # than one thread, and a process with threads must not fork: one thread here. A forked
    # worker's numpy BLAS stays single-threaded (the trainer uses numpy for RNG state only;
    # torch's threads are set per rank as before); a node that sets it keeps its own (and cold
    # workers, if it is above 1).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for name in PRELOAD:
        importlib.import_module(name)
    built = _prebuild()
    unsafe = _fork_unsafe()
    print(f"ddpkit warm: template {os.getpid()} ready in {time.time() - t:.2f}s ({built})"
          + (f"; {unsafe}: forking is unsafe, the workers start cold" if unsafe else ""),
          file=sys.stderr, flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(0, selectors.EVENT_READ, "stdin")
    workers: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (its client's connection, pid)
    conns: dict[socket.socket, int] = {}  # connection -> pidfd
    while True:
        for key, _ in sel.select():
            what = key.data
            if what == "stdin":
                if not os.read(0, 4096):  # the launcher closed it (or died): the end
                    for _, pid in workers.values():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    return 0
            elif what == "accept":
                conn, _ = listener.accept()
                if unsafe:  # the client execs its worker cold at once (after its request is read)
                    with contextlib.suppress(OSError, ValueError):
                        conn.settimeout(10)
                        for fd in (_recv(conn, 3) or (None, []))[1]:
                            os.close(fd)
                        _send(conn, {"cold": f"the template found {unsafe}"})
                    conn.close()
                    continue
                pidfd = _fork_worker(conn, listener, sel, workers)
                if pidfd is None:
                    conn.close()
                    continue
                sel.register(pidfd, selectors.EVENT_READ, "exit")
                sel.register(conn, selectors.EVENT_READ, "conn")
                conns[conn] = pidfd
            elif what == "conn":  # a client sends nothing more: readable means it is gone
                conn = key.fileobj
                with contextlib.suppress(OSError):
                    if conn.recv(1):
                        continue
                sel.unregister(conn)
                _, pid = workers[conns.pop(conn)]
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # the client died first: its worker goes too
            elif what == "exit":
                pidfd = key.fd
                conn, pid = workers.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                if conn in conns:
                    sel.unregister(conn)
                    conns.pop(conn)
                    with contextlib.suppress(OSError):
                        _send(conn, {"status": status})
                conn.close()


def _fork_unsafe() -> str | None:
    """Why forking this process would not be safe (None: it is): another thread (a library
    that started one at import holds locks a child would copy mid-use), or CUDA initialized
    (a forked child cannot use it)."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        return f"{threads} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA initialized"
    return None


def _prebuild() -> str:
    """The job's built-in workload (data set and initial model: fixed seeds, so every worker's
    is the same), made once here on one thread (no OpenMP pool in a process that forks); what
    was done, in words. A job file the worker will refuse is left for the worker to report."""
    from trainer.contract import JOB_FILE_VAR

    if not os.environ.get(JOB_FILE_VAR):
        return "torch imported"
    import torch

    from trainer.config import load_job_sections
    from trainer.models import prebuild

    DEFAULT_THREADS.append(torch.get_num_threads())
    torch.set_num_threads(1)
    try:
        name = prebuild(load_job_sections().train)
    except Exception as e:  # noqa: BLE001  (the worker builds it again and says what is wrong)
        return f"torch imported; the workload was not built: {type(e).__name__}"
    return f"torch imported, workload {name} built" if name else "torch imported"


def _fork_worker(conn: socket.socket, listener: socket.socket, sel, workers: dict) -> int | None:
    """Read a client's request and fork its worker; the worker's pidfd (None: a bad request)."""
    conn.settimeout(10)
    try:
        got = _recv(conn, 3)
    except (OSError, ValueError):
        got = None
    conn.settimeout(None)
    if got is None or len(got[1]) != 3:
        for fd in got[1] if got else []:
            os.close(fd)
        return None
    request, fds = got
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sel.close()
            listener.close()
            for pidfd, (other, _) in workers.items():
                os.close(pidfd)
                other.close()
            code = _child(request, fds, conn)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    workers[pidfd] = (conn, pid)
    with contextlib.suppress(OSError):
        _send(conn, {"pid": pid})
    return pidfd


def _child(request: dict, fds: list[int], conn: socket.socket) -> int:
    """In the forked worker: become the process `python ENTRY` would have been, run it, and
    return its exit code (the caller `_exit`s with it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the template's death ends the worker
    if os.getppid() == 1:
        return 1
    os.setsid()  # its own process group, as torchrun gives each worker
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    rank = os.environ.get("RANK", "")
    libc.prctl(15, f"ddpkit-rank{rank}".encode()[:15])  # PR_SET_NAME: ps and the benches find it
    _reset_process()
    FORKED.update(template=os.getppid(), forked=time.time(), client_t0=float(request["t0"]),
                  client=int(request["pid"]), agent=int(request["ppid"]))
    entry = list(request["argv"])
    try:
        if entry[:2] == ["-m", "trainer.train"] or entry[:2] == ["-m", "trainer"]:
            import trainer.train

            sys.argv = [trainer.train.__file__, *entry[2:]]
            trainer.train.WORKER_T0 = FORKED["client_t0"]
            trainer.train.entry()
        else:
            import runpy

            if entry[0] == "-m":
                sys.argv = [entry[1], *entry[2:]]
                runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(entry)
                sys.path.insert(0, os.path.dirname(os.path.abspath(entry[0])))
                runpy.run_path(entry[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else _say(e.code))
    except BaseException:  # noqa: BLE001  (as the interpreter would: traceback, exit 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    finish_like_exit()
    return code


def _say(message: object) -> int:
    print(message, file=sys.stderr, flush=True)
    return 1


def _reset_process() -> None:
    """What a fresh interpreter has and a fork would share with the template: default signal
    dispositions, streams opened on the worker's descriptors, unseeded RNGs."""
    import io
    import random

    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        raw = open(fd, mode + "b", buffering=0, closefd=False)  # noqa: SIM115
        tty = os.isatty(fd)
        if mode == "r":
            stream = io.TextIOWrapper(io.BufferedReader(raw), line_buffering=tty)
        else:
            buffered = raw if unbuffered else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(buffered, line_buffering=tty or fd == 2, write_through=unbuffered or fd == 2,
                                      errors="backslashreplace" if fd == 2 else "strict")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:  # a fresh `import torch` seeds its generator at random too
        torch = sys.modules["torch"]
        torch.random.default_generator.seed()
        if DEFAULT_THREADS:
            torch.set_num_threads(DEFAULT_THREADS[0])


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


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"] and len(argv) in (2, 3) and argv[2:] in ([], ["--now"]):
        return serve(argv[1], now=argv[2:] == ["--now"])
    if not argv:
        print("usage: python -m trainer.warm ENTRY... (a worker) | --serve SOCKET [--now] (the template)",
              file=sys.stderr)
        return 2
    return client(argv)


if __name__ == "__main__":
    # Through the module's own name: a forked worker's `trainer.warm.FORKED` is this one's.
    from trainer.warm import main as _main

    sys.exit(_main(sys.argv[1:]))
