"""torchrun as a supervised child of the node's launcher: stop signals forwarded, a stopped
run mapped to a stop exit code, and the launcher's half of warm restarts.

torchrun runs as a child rather than by exec: torchrun exits 1 after forwarding SIGTERM to its
workers, which would turn a clean preemption (workers checkpoint and exit 143) into a permanent
failure for Kubeflow's ExitCode policy. The launcher forwards SIGTERM, SIGINT, SIGHUP and
SIGUSR2 (torchrun is told to forward USR2 too). Exit codes after a stop (`trainer.contract`):
`EXIT_STOPPED` (143) only when the workers wrote their stop checkpoint (they say so through
`DDPKIT_STOP_FILE`), `EXIT_STOPPED_UNSAVED` (137) when a stop signal arrived but no checkpoint
was written (killed mid-step or mid-save, or stopped before training began); both are
retryable (Kubeflow's ExitCode policy: 128-255; the sbatch script requeues on any failure after
its signal). torchrun waits `DDPKIT_STOP_GRACE_S` (the target's grace period:
terminationGracePeriodSeconds, the Slurm signal lead; default `DEFAULT_STOP_GRACE_S`) for the
workers' stop checkpoint before it kills them (`--shutdown-timeout`; torch's default of 30 s
would cut off a slow step or save whatever the grace period).

Warm restarts (trainer/warm.py has the design and the measurements that chose it): in torchrun
mode the launcher also starts the node's template process, which imports torch and the trainer
(and builds a built-in workload) once, when the first worker is asked for (on a one-node job at
once, beside torchrun's own start), and torchrun runs `python -m trainer.warm ENTRY`, a
standard-library client that has the template fork the worker and then stands in for it (its
exit code or signal, stop signals forwarded, and a client that dies takes its worker with it).
A restart by torchrun then costs a fork, not `import torch` and `import torch._dynamo` again.
`train.warm_restarts` (default true) applies to the built-in trainer and preflight; a `script`
or `module` job starts cold unless the node sets `DDPKIT_WARM=1` (its imports and whether they
survive a fork are its own); `DDPKIT_WARM=0` starts every worker cold. The srun-per-GPU mode
execs the trainer cold as before: Slurm starts every task itself and restarts only by a requeue
or a new job step, where all processes are new (and may be on other nodes); a template there
would pay the same import once per step. Likewise a worker already under torchrun.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer import attempts
from trainer.contract import (
    EXIT_FAILURE,
    EXIT_STOPPED,
    EXIT_STOPPED_UNSAVED,
    RESIDENT_VAR,
    STOP_FILE_VAR,
    TORCHRUN_T0_VAR,
    WARM_SOCKET_VAR,
    resident_socket,
)
from trainer.launch import script_stop
from trainer.launch.plan import endpoint

#: The stop signals the launcher passes on to torchrun (all of `contract.TORCHRUN_SIGNALS` but SIGQUIT).
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR2")


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Linux: the child gets `signum` if the shim dies (even by SIGKILL); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_template(sock: str, env: dict[str, str], now: bool = False) -> subprocess.Popen:
    """The node's template process (trainer/warm.py): it binds `sock` at once, imports torch
    and the trainer (`now`: at once, else when the first worker is asked for), then forks a
    worker per client; it ends when its stdin closes, and with SIGKILL if the shim dies. Its
    own session: a terminal's Ctrl-C is not its business."""
    return subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", sock, *(["--now"] if now else [])],
                            env=env,
                            stdin=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: _die_with_parent(signal.SIGKILL))


def end_template(template: subprocess.Popen) -> None:
    """Close the template's stdin (it kills any worker left and exits); bounded wait."""
    with contextlib.suppress(OSError):
        template.stdin.close()
    try:
        template.wait(timeout=5)
    except subprocess.TimeoutExpired:
        template.kill()
        template.wait()


def supervise(argv: list[str], env: dict[str, str], log: Callable[[str], None] = print,
              record: attempts.LaunchRecord | None = None, warm: bool = False, warm_now: bool = False,
              store: tuple[str, int] | None = None, script: bool = False) -> int:
    """Run torchrun as a child, forward stop signals, map a stopped run to a stop exit code.

    `EXIT_STOPPED` (143): a worker wrote `DDPKIT_STOP_FILE` after its stop checkpoint was
    complete on every rank (whichever way the stop request reached it); torchrun itself exits 1
    then. `EXIT_STOPPED_UNSAVED` (137): this shim got a stop signal and no checkpoint was written.
    With a `record`, torchrun's stderr passes through this process: the failed workers it
    reports and its last lines are written to the run directory (trainer/attempts.py).
    With `warm`, the node's template process (`start_template`) runs beside torchrun, its socket
    in the same private directory; `warm_now`: it imports at once (a one-node job: no other
    node's rendezvous to slow down). Inside a Slurm allocation whose batch shell started a
    resident template per node (`RESIDENT_VAR`), that one is used and forks torchrun's agent
    too: the child here is then `python -m trainer.warm --agent` (standard library only), which
    stands in for torchrun as a worker's client stands in for a worker (exit code or signal,
    stop signals forwarded; if it dies the template SIGKILLs torchrun): a new job step imports
    nothing. `store`: the rendezvous store on another node
    (`wait_for_torchrun` ends torchrun when that store stops answering). `script`: the workers
    run your own script, whose stop ends in seconds (trainer/launch/script_stop.py).
    """
    import tempfile

    stop_dir = tempfile.mkdtemp(prefix="ddpkit-launch-")
    stop_file = os.path.join(stop_dir, "stopped")
    env = {**env, STOP_FILE_VAR: stop_file, TORCHRUN_T0_VAR: repr(time.time())}  # a launch mark
    # torchrun's own directory (the workers' error files) goes in ours, which goes at the end:
    # without --log-dir torchrun makes a /tmp/torchelastic_* per run and never removes it.
    # PET_LOG_DIR is torchrun's --log-dir default; a --log-dir in train.torchrun_args wins.
    env.setdefault("PET_LOG_DIR", os.path.join(stop_dir, "torchelastic"))
    template = None
    if warm:
        argv, template = warm_template(argv, env, stop_dir, log, now=warm_now)
        if template is not None and record is not None:
            record.template_pid = template.pid
    # Own session: a terminal's Ctrl-C reaches torchrun once (from us), not twice.
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                            stderr=subprocess.PIPE if record else None)
    relay = _relay_stderr(proc, record) if record else None
    stopped: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if signum != signal.SIGHUP:
            stopped.append(signum)
            if script and len(stopped) == 1:
                script_stop.on_stop(proc, stop_file, log)
        proc.send_signal(signum)

    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), forward)
    forked = warm and template is None  # torchrun's agent is the resident template's child
    rc = wait_for_torchrun(proc, store, log, agent=(lambda: forked_agent(stop_file) or proc.pid) if forked else None)
    if template is not None:
        end_template(template)
        with contextlib.suppress(OSError):
            os.unlink(env[WARM_SOCKET_VAR])
    if relay is not None:
        relay.join(timeout=5)
    saved = _stop_checkpoint(stop_file)
    shutil.rmtree(stop_dir, ignore_errors=True)
    code = _exit_code(rc, saved, stopped, log)
    if record is not None:
        record.write(rc, code)
        if record.oom_kills:
            log(f"{attempts.OOM_LINE} {record.oom_kills} process(es) in this node's memory cgroup while "
                "torchrun ran: a worker's SIGKILL (-9) is out of memory")
    return code


def warm_template(argv: list[str], env: dict[str, str], folder: str, log: Callable[[str], None],
                  now: bool = False) -> tuple[list[str], subprocess.Popen | None]:
    """The template that forks this torchrun's workers, its socket in `env` (`WARM_SOCKET_VAR`):
    the allocation's resident one where it answers (it forks torchrun's agent too: the argv
    returned starts `trainer.warm --agent`), else one of our own in `folder` (returned, for
    `end_template`)."""
    prefix = env.get(RESIDENT_VAR)
    sock = resident_template(resident_socket(prefix, env) if prefix else None, log)
    template = None
    if sock is not None:  # the allocation's template forks torchrun too
        argv = [argv[0], "-m", "trainer.warm", "--agent", *argv[1:]]
    else:
        sock = os.path.join(folder, "warm.sock")
        template = start_template(sock, env, now=now)
    env[WARM_SOCKET_VAR] = sock
    return argv, template


def _stop_checkpoint(stop_file: str) -> str | None:
    """The step a worker wrote to `DDPKIT_STOP_FILE` after its stop checkpoint; None: none."""
    try:
        return open(stop_file).read().strip() or "?"
    except OSError:
        return None


#: torchrun without a worker for this long, not exiting: is its rendezvous store still there?
IDLE_BEFORE_PROBE_S = 5.0
#: The store must answer a request within this (connecting included).
STORE_PROBE_S = 10.0


def forked_agent(stop_file: str) -> int | None:
    """The pid of torchrun's agent when a template forked it (trainer/warm.py `AGENT_NAME`):
    the process of that name whose environment has this launcher's own stop file."""
    from trainer.warm import AGENT_NAME

    mine = f"{STOP_FILE_VAR}={stop_file}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if (Path(f"/proc/{pid}/comm").read_text().strip() == AGENT_NAME
                    and mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                return int(pid)
    return None


#: How long a launcher waits for its allocation's resident template (started beside the first
#: job step) to listen before it starts a template of its own.
RESIDENT_WAIT_S = 10.0


def resident_template(path: str | None, log: Callable[[str], None]) -> str | None:
    """The socket of the allocation's resident template (`RESIDENT_VAR`, trainer/warm.py) when
    it listens on this node in a directory of this user's alone; None: start our own."""
    if not path:
        return None
    from trainer.warm import private_dir_problem

    deadline = time.monotonic() + RESIDENT_WAIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    why = private_dir_problem(os.path.dirname(path)) if os.path.exists(path) else f"no socket at {path}"
    if not why:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError as e:  # refused: the template is gone (a socket file left behind)
                why = f"{path}: {e.strerror}"
    if why:
        log(f"warm restarts: the allocation's template is not usable ({why}): this node starts its own")
        return None
    log(f"warm restarts: torchrun and the workers are forked from the allocation's template ({path})")
    return path


def wait_for_torchrun(proc: subprocess.Popen, store: tuple[str, int] | None, log: Callable[[str], None],
                      agent: Callable[[], int] | None = None) -> int:
    """torchrun's exit code; with `store` (the rendezvous store on another node), also watch
    for a torchrun that can never exit: torch's TCPStore client (2.13) logs its timeout, then
    retries an unanswered request without end, so once the store's host is gone without a
    reset (a node that died with its link, or froze) torchrun hangs in its rendezvous or
    shutdown after its workers ended (their watchdog ends them: trainer/watchdog.py). When
    torchrun has had no worker for `IDLE_BEFORE_PROBE_S` and the store does not answer within
    `STORE_PROBE_S`, torchrun is ended and the node exits 1, as torchrun does after a failed
    worker; the target restarts the node where restarts are left. A refused or reset
    connection (the store's process ended: a finished run) is torchrun's own to handle.
    `agent`: torchrun's pid when `proc` only stands in for it (forked by the template)."""
    if store is None:
        return proc.wait()
    idle_since: float | None = None
    while True:
        try:
            return proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        if _children(agent() if agent else proc.pid):
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if time.monotonic() - idle_since < IDLE_BEFORE_PROBE_S:
            continue
        if store_answers(*store, STORE_PROBE_S) or proc.poll() is not None:
            idle_since = time.monotonic()
            continue
        log(f"torchrun has had no worker for {time.monotonic() - idle_since:.0f}s and its rendezvous store "
            f"{endpoint(*store)} does not answer within {STORE_PROBE_S:.0f}s: node rank 0, its host, is "
            f"gone, frozen or cut off, and torchrun would wait for it for good; ending torchrun: exit {EXIT_FAILURE}")
        _end(proc)
        return EXIT_FAILURE


def _children(pid: int) -> list[int]:
    """The live children of `pid` (a worker that exited but was not reaped is a zombie: gone)."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            state, ppid = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            if ppid == str(pid) and state != "Z":
                found.append(int(p))
    return found


def store_answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether the c10d store at host:port answers a request (or its host refuses the
    connection: the store's process ended, its host did not) within `timeout_s`. A daemon
    thread asks: the call itself may never return."""
    import datetime

    started = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # no route, no answer in time, a name that no longer resolves
        return False

    try:
        import torch.distributed as dist  # only here: a launcher that never probes never imports torch
    except ImportError:
        return True  # no way to ask: torchrun's own business
    outcome = threading.Event()
    left = max(1.0, timeout_s - (time.monotonic() - started))

    def ask() -> None:
        try:
            dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=left),
                          wait_for_workers=False).check(["ddpkit/probe"])
        except Exception:  # noqa: BLE001  (reset: an answer of sorts; torch's own timeout: none)
            if time.monotonic() - started >= timeout_s:
                return
        outcome.set()

    threading.Thread(target=ask, name="ddpkit-store-probe", daemon=True).start()
    return outcome.wait(left)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun's process group, SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _exit_code(rc: int, saved: str | None, stopped: list[int], log: Callable[[str], None]) -> int:
    if rc == 0:
        return 0
    if saved is not None:
        log(f"stopped after the checkpoint of step {saved}: exit {EXIT_STOPPED}")
        return EXIT_STOPPED
    if stopped:
        log(f"stopped by {signal.Signals(stopped[0]).name} before a checkpoint was written "
            f"(torchrun exit {rc}): exit {EXIT_STOPPED_UNSAVED}; a restart resumes from the previous one")
        return EXIT_STOPPED_UNSAVED
    return 128 - rc if rc < 0 else rc  # torchrun killed by a signal: the shell's 128+N


def _relay_stderr(proc: subprocess.Popen, record: attempts.LaunchRecord) -> threading.Thread:
    """A thread that copies torchrun's stderr to ours as it comes and feeds `record`."""
    def relay() -> None:
        out = sys.stderr.buffer
        for raw in proc.stderr:
            with contextlib.suppress(OSError, ValueError):
                out.write(raw)
                out.flush()
            record.feed(raw.decode("utf-8", errors="replace"))

    thread = threading.Thread(target=relay, name="ddpkit-stderr", daemon=True)
    thread.start()
    return thread
