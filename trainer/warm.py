"""Warm restarts: a node's template process imports torch and the trainer once and forks the
workers; torchrun starts a tiny client per worker instead of a fresh `python -m trainer.train`.

Why (bench/launch_time.py `--kills`, docs/faults.md "Warm restarts"): a cold restart
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

A launcher's own template imports when the first worker is asked for (a one-node job's at once,
`--now`), while torchrun imports torch itself and meets the other nodes; it ignores the stop
signals (Slurm signals every process of a step; the workers get theirs through their clients)
and ends when the launcher closes its stdin or dies (then the workers get SIGKILL, not
torchrun's graceful stop: a launcher killed outright is a node lost).

Inside a Slurm allocation that restarts in place (spare nodes, an elastic range), a new job step
would still pay torchrun's and the template's imports: the batch shell starts a resident
template per node (`--resident`, its own step), and each step's launcher has it fork torchrun
itself: the launcher's child is `python -m trainer.warm --agent -m torch.distributed.run ...`,
torchrun's stand-in as a worker's client is the worker's (the agent's request keeps the socket
in its environment, so its workers are clients too). Measured on the Slurm testbed
(`bench/slurm_restart_in_step.py`, a new job step on 2 nodes that share 2 cores, 4 kills each):
kill -> first step 2.35 s against 8.32 s cold. A launcher's own template can fork the agent too
(5.88 s against 8.51 s in the same bench), but that is not used: in CI it changed when pods'
memory peaked and how signals reach torchrun, and it gains nothing where restarts happen inside
torchrun. A forked agent gets each stop signal several times (`_stop_signal_once`).
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
from pathlib import Path

from trainer.contract import (
    STOP_FILE_VAR,
    TORCHRUN_SIGNALS,
    WARM_SOCKET_VAR,
    resident_socket,
    warm_worker_file,
)
from trainer.forked import FORKED, finish_like_exit

#: The signals a client passes on to its worker (those torchrun passes on to its workers); the
#: template ignores them.
FORWARDED = tuple(getattr(signal, name) for name in TORCHRUN_SIGNALS)
#: How long a client waits for the template's socket to appear before it starts cold.
CONNECT_WAIT_S = 10.0
#: What the template imports once (the built-in trainer's imports, `torch._dynamo` included:
#: the first optimizer and DDP's constructor import it).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.optim",
           "torch.utils.data", "torch.distributed.elastic.multiprocessing.errors",
           "torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "numpy", "yaml", "pydantic", "tqdm",
           "trainer.config", "trainer.dist", "trainer.data", "trainer.models", "trainer.checkpoint",
           "trainer.train", "trainer.preflight")
#: What torchrun's agent needs: imported before the template forks it (the rest of `PRELOAD` after).
#: Not torch.distributed.run itself: `python -m` runs it as __main__, and runpy warns when it
#: was imported already.
AGENT_PRELOAD = ("torch", "torch.distributed.launcher.api", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend")
#: torch answers `cuda.is_available()`/`device_count()` through NVML, not the CUDA runtime.
NVML_CHECK_VAR = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: How long the template waits for a worker it SIGKILLed to be gone before it forks another:
#: a successor forked first could find the GPU memory of its predecessor still held.
REAP_WAIT_S = 60.0
#: Objects that must live as long as the process (the signal wakeup socket).
_KEEP: list[socket.socket] = []
#: The forked agent's process name (the workers' is `ddpkit-rank<R>`).
AGENT_NAME = "ddpkit-agent"
#: torch's thread count before the template built the workload on one thread (a worker gets it back).
DEFAULT_THREADS: list[int] = []


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
def client(entry: list[str], agent: bool = False) -> int:
    """Have the template fork the worker `entry` (what follows `python`), then be that worker
    for torchrun; without a template, exec the worker cold. `agent`: the entry is torchrun
    itself (the launcher's client), which keeps `DDPKIT_WARM_SOCKET`: its workers are clients."""
    t0 = time.time()
    path = os.environ.get(WARM_SOCKET_VAR, "")
    sock = _connect(path) if path else None
    if sock is None:
        return _cold(entry, f"no template at {path or '(DDPKIT_WARM_SOCKET unset)'}", agent)
    env = {k: v for k, v in os.environ.items() if agent or k != WARM_SOCKET_VAR}
    try:
        _send(sock, {"argv": entry, "env": env, "cwd": os.getcwd(), "t0": t0, "pid": os.getpid(),
                     "ppid": os.getppid(), "agent": agent}, [0, 1, 2])
        reply = _recv(sock)
    except OSError as e:
        reply, why = None, str(e)
    else:
        why = "it closed the connection"
    if reply is not None and "cold" in reply[0]:
        return _cold(entry, reply[0]["cold"], agent)
    if reply is None or "pid" not in reply[0]:
        return _cold(entry, f"the template at {path} did not start the worker ({why})", agent)
    pid = int(reply[0]["pid"])
    if not agent:
        _publish_worker(pid)

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


def _publish_worker(pid: int) -> None:
    """Say which process is this client's worker, for a script job's stop (`warm_worker_file`)."""
    stop_file = os.environ.get(STOP_FILE_VAR)
    if stop_file:
        with contextlib.suppress(OSError):
            Path(warm_worker_file(stop_file, os.getpid())).write_text(str(pid))


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


def _cold(entry: list[str], why: str, agent: bool = False) -> int:
    print(f"ddpkit warm: {why}; starting {'torchrun' if agent else 'the worker'} cold", file=sys.stderr, flush=True)
    if not agent:  # torchrun's workers still ask the template (and learn why from it)
        os.environ.pop(WARM_SOCKET_VAR, None)
    os.execv(sys.executable, [sys.executable, *entry])
    return 1  # not reached


# -- the template --------------------------------------------------------------------------------
def serve(path: str, resident: bool = False, now: bool = False) -> int:
    """Listen on `path`; once the first client connects (`now`: at once), import `AGENT_PRELOAD`,
    then fork a process per request (torchrun's agent if it asks, then its workers) until stdin
    closes; the rest of `PRELOAD` and the workload are done before the first worker is forked
    (after an agent's fork: while it starts and meets the other nodes).

    `resident`: the template of a whole Slurm allocation (`RESIDENT_VAR`), its own job step on
    each node, that the job steps' launchers use instead of starting their own. It makes the
    socket's private directory (`_listen`), imports at once, does not read stdin (srun gives a
    task none), and ends on SIGTERM, SIGINT or SIGHUP once the processes it forked have ended
    (a time limit signals every step at once: the workers must have their stop checkpoint).

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
    listener = _listen(path, resident)
    if listener is None:
        return 1
    end = _end_signals() if resident else None  # before the imports: a signal during them counts
    if not (resident or now) and not _first_client(listener):
        return 0
    t0 = time.time()
    # numpy's OpenBLAS (torch imports numpy) starts a thread pool at import when it may use more
    # than one thread, and a process with threads must not fork: one thread here. A forked
    # worker's numpy BLAS stays single-threaded (the trainer uses numpy for RNG state only;
    # torch's threads are set per rank as before); a node that sets it keeps its own (and cold
    # workers, if it is above 1).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # torch's documented way to ask about GPUs without initializing CUDA (a device count through
    # the runtime would, and every worker forked after it could not use CUDA): NVML. A worker's
    # environment is its client's again (`_child`).
    os.environ[NVML_CHECK_VAR] = "1"
    _import(AGENT_PRELOAD)
    preloaded: list[str] = []  # what `preload` did, once it ran

    def preload() -> None:
        if not preloaded:
            _import(PRELOAD)
            preloaded.append(_prebuild())
            unsafe = _fork_unsafe()
            print(f"ddpkit warm: template {os.getpid()} ready in {time.time() - t0:.2f}s ({preloaded[0]})"
                  + (f"; {unsafe}: forking is unsafe, the workers start cold" if unsafe else ""),
                  file=sys.stderr, flush=True)

    if resident or now:
        preload()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(end if end is not None else 0, selectors.EVENT_READ, "end" if resident else "stdin")
    workers: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (its client's connection, pid)
    conns: dict[socket.socket, int] = {}  # connection -> pidfd
    ending = False
    while True:
        if ending and not workers:
            _unlisten(listener, path)
            return 0
        # Exits and gone clients first: a worker whose client died is reaped before a new
        # client (its successor, after torchrun's restart) is forked.
        for key, _ in sorted(sel.select(), key=lambda event: event[0].data == "accept"):
            what = key.data
            if what == "end":
                with contextlib.suppress(OSError):
                    key.fileobj.recv(64)
                if not ending:
                    sel.unregister(listener)  # no new clients
                ending = True
            elif what == "stdin":
                if not os.read(0, 4096):  # the launcher closed it (or died): the end
                    for _, pid in workers.values():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    return 0
            elif what == "accept":
                conn, _ = listener.accept()
                request = _read_request(conn)
                if request is None:
                    conn.close()
                    continue
                if not request[0].get("agent"):
                    preload()
                pidfd = _fork_or_refuse(request, conn, listener, sel, workers)
                if pidfd is not None:
                    sel.register(pidfd, selectors.EVENT_READ, "exit")
                    sel.register(conn, selectors.EVENT_READ, "conn")
                    conns[conn] = pidfd
                preload()  # after the agent: while it starts and meets the other nodes
            elif what == "conn":  # a client sends nothing more: readable means it is gone
                conn = key.fileobj
                if conn not in conns:  # its worker's exit was handled in this round
                    continue
                with contextlib.suppress(OSError):
                    if conn.recv(1):
                        continue
                sel.unregister(conn)
                pidfd = conns.pop(conn)
                if not _kill_and_reap(workers[pidfd][1], pidfd):  # the client died first: its worker goes too
                    continue  # still there: reaped on its exit event
                sel.unregister(pidfd)
                workers.pop(pidfd)
                os.close(pidfd)
                conn.close()
            elif what == "exit":
                pidfd = key.fd
                if pidfd not in workers:  # reaped already in this round (its client was gone)
                    continue
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


def _kill_and_reap(pid: int, pidfd: int, wait_s: float = REAP_WAIT_S) -> bool:
    """SIGKILL a worker and wait (at most `wait_s`) until the kernel has taken it down, its
    device memory released with its files; True once reaped."""
    import select

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not select.select([pidfd], [], [], wait_s)[0]:
        print(f"ddpkit warm: worker {pid} still not gone {wait_s:.0f}s after SIGKILL", file=sys.stderr, flush=True)
        return False
    os.waitpid(pid, 0)
    return True


def _listen(path: str, resident: bool) -> socket.socket | None:
    """The listening socket; a resident template first makes its private directory (or finds
    its own, from an earlier start on this node: a stale socket is replaced). None (said why)
    when the directory is not this user's alone: another user's socket could be served our
    workers' environment."""
    if resident:
        folder = os.path.dirname(path)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        why = private_dir_problem(folder)
        if why:
            print(f"ddpkit warm: not serving at {path}: {why}", file=sys.stderr, flush=True)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    # Bound under a temporary name and renamed once it listens: a client that finds `path`
    # between a bind and a listen is refused and would start its worker cold (CI saw it once,
    # on a loaded machine); a refusal means the template is gone, never that it is starting.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unready = f"{path}.{os.getpid()}"
    listener.bind(unready)
    listener.listen(64)
    os.rename(unready, path)
    return listener


def private_dir_problem(folder: str) -> str | None:
    """Why `folder` may not hold a template's socket (None: it may): it must be a directory,
    not a link, owned by this user and closed to everyone else."""
    import stat

    try:
        st = os.lstat(folder)
    except OSError as e:
        return f"{folder}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return f"{folder} is not a directory of this user's alone (mode {stat.filemode(st.st_mode)}, uid {st.st_uid})"
    return None


def _first_client(listener: socket.socket) -> bool:
    """Wait until a client connects (True) or the launcher closes stdin first (False)."""
    import selectors

    with selectors.DefaultSelector() as first:
        first.register(listener, selectors.EVENT_READ, "accept")
        first.register(0, selectors.EVENT_READ, "stdin")
        while not any(key.data == "accept" for key, _ in first.select()):
            if not os.read(0, 4096):
                return False
    return True


def _end_signals() -> socket.socket:
    """A socket that becomes readable when SIGTERM, SIGINT or SIGHUP comes (a resident
    template's end; it keeps ignoring SIGQUIT and SIGUSR2, which stop the workers)."""
    readable, writable = socket.socketpair()
    writable.setblocking(False)
    signal.set_wakeup_fd(writable.fileno(), warn_on_full_buffer=False)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    _KEEP.extend((readable, writable))
    return readable


def _unlisten(listener: socket.socket, path: str) -> None:
    listener.close()
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def _import(names: tuple[str, ...]) -> None:
    import importlib

    for name in names:
        importlib.import_module(name)


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
    if _cuda_driver_loaded():
        return "the CUDA driver loaded (a GPU query through the CUDA runtime)"
    return None


def _cuda_driver_loaded(maps: str = "/proc/self/maps") -> bool:
    """Whether libcuda is mapped into this process: the CUDA runtime loads it at its first call
    (`cudaGetDeviceCount` too, which `torch.cuda.is_initialized()` does not see); a forked child
    of a process that initialized the driver cannot use CUDA. NVML queries do not load it."""
    try:
        with open(maps) as f:
            return any("/libcuda.so" in line for line in f)
    except OSError:
        return False


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


def _read_request(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """A client's request and its three descriptors; None for a bad one (nothing kept open)."""
    conn.settimeout(10)
    try:
        got = _recv(conn, 3)
    except (OSError, ValueError):
        got = None
    conn.settimeout(None)
    if got is None or len(got[1]) != 3 or not isinstance(got[0], dict):
        for fd in got[1] if got else []:
            os.close(fd)
        return None
    return got


def _fork_or_refuse(request: tuple[dict, list[int]], conn: socket.socket, listener: socket.socket, sel,
                    workers: dict) -> int | None:
    """Fork the client's process, or tell it to start cold when forking is unsafe (the client
    then execs it itself); the forked process's pidfd, None when refused."""
    body, fds = request
    unsafe = _fork_unsafe()
    if unsafe:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            _send(conn, {"cold": f"the template found {unsafe}"})
        conn.close()
        return None
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
            code = _child(body, fds, conn)
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
    # PR_SET_NAME: ps, the benches and the launcher (`forked_agent`) find it by this name
    name = AGENT_NAME if request.get("agent") else f"ddpkit-rank{os.environ.get('RANK', '')}"
    libc.prctl(15, name.encode()[:15])
    _reset_process()
    FORKED.update(template=os.getppid(), forked=time.time(), client_t0=float(request["t0"]),
                  client=int(request["pid"]), agent=int(request["ppid"]))
    entry = list(request["argv"])
    try:
        if entry[:2] == ["-m", "trainer.train"] or entry[:2] == ["-m", "trainer"]:
            import trainer.train

            sys.argv = [trainer.train.__file__, *entry[2:]]
            trainer.train.entry()
        else:
            import runpy

            if request.get("agent"):
                _stop_signal_once()
            if entry[0] == "-m":
                sys.argv = [entry[1], *entry[2:]]
                runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(entry)
                sys.path.insert(0, os.path.dirname(os.path.abspath(entry[0])))
                runpy.run_path(os.path.abspath(entry[0]), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else _say(e.code))
    except BaseException as e:  # noqa: BLE001  (as the interpreter would: traceback, exit 1)
        tb = e.__traceback__  # without this module's frames: the entry's own, as `python -m` shows it
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    finish_like_exit()
    return code


def _stop_signal_once() -> None:
    """In the forked torchrun agent: torchrun's stop-signal handler raises on the first stop
    signal only. A forked agent gets a stop signal more than once: Slurm signals every process
    of a step (the agent, its client, which forwards it, and the launcher, which forwards to
    the client), and so does a test that signals a whole process tree. torchrun raises
    SignalException on each, and one that comes during its shutdown (while it waits up to the
    grace period for the workers' stop checkpoint) ends it at once with exit 1: the checkpoint
    is cut short and the node's exit says nothing was saved. Escalation is still SIGKILL's."""
    from torch.distributed.elastic.multiprocessing import api

    first = api._terminate_process_handler
    seen: list[int] = []

    def once(signum: int, frame: object) -> None:
        if not seen:
            seen.append(signum)
            first(signum, frame)

    api._terminate_process_handler = once  # looked up when torchrun installs its handlers


def _say(message: object) -> int:
    print(message, file=sys.stderr, flush=True)
    return 1


def _reset_process() -> None:
    """What a fresh interpreter has and a fork would share with the template: default signal
    dispositions, streams opened on the worker's descriptors, unseeded RNGs."""
    import io
    import random

    signal.set_wakeup_fd(-1)  # a resident template's, which a signal here must not wake
    for sock in _KEEP:
        sock.close()
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



def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"] and len(argv) in (2, 3) and argv[2:] in ([], ["--now"]):
        return serve(argv[1], now=argv[2:] == ["--now"])
    if argv[:1] == ["--resident"] and len(argv) == 2:
        return serve(resident_socket(argv[1], os.environ), resident=True)
    agent = argv[:1] == ["--agent"]
    if not argv[agent:]:
        print("usage: python -m trainer.warm [--agent] ENTRY... (a worker, or with --agent torchrun) "
              "| --serve SOCKET [--now] (the template) | --resident PREFIX (a Slurm allocation's)", file=sys.stderr)
        return 2
    return client(argv[agent:], agent=agent)


if __name__ == "__main__":
    # Through the module's own name: a forked worker's module state (`_KEEP`, `DEFAULT_THREADS`) is this one's.
    from trainer.warm import main as _main

    sys.exit(_main(sys.argv[1:]))
