"""The hang watchdog: a rank that stops making progress is found in seconds, not after the
collective timeout, with every rank's Python stacks and one verdict line naming the culprit.

Every rank's main thread says where it is (`Heartbeat.beat(phase, step)`: a few attribute
writes, no system call). A daemon thread per rank publishes that heartbeat to the job's c10d
store every `PUBLISH_EVERY_S` through its own client connection (so it works while the main
thread is blocked in a collective), and checks the age of the current phase against its
deadline:

- the phases of a step (`data`, `forward`, `backward`, `optimizer`, `vote`):
  max(`train.hang_floor_s`, `train.hang_factor` x the p99 step time of this attempt), once
  `WARM_STEPS` steps have been timed (before that, and for a phase never timed:
  `train.timeout_s`, the collective timeout);
- `checkpoint` and `eval`: max(floor, factor x the longest one of this attempt so far), the
  first one `train.timeout_s`.

The first rank whose phase outlives its deadline raises the job's hang flag in the store; so
does a rank that has waited in a collective for over `train.hang_floor_s` while the next rank's
heartbeat is older than that (a rank frozen, or lost with its node, whatever the deadline). Every
rank that sees the flag writes its stacks (`faulthandler`, all threads) to
`RUN_DIR/debug/attempt-N/rank-R.txt`. The rank that raised the flag waits `DUMP_WAIT_S` for
them, reads every rank's heartbeat and writes the verdict (`verdict.txt` beside the stacks, and
a `ddpkit-hang {json}` line): the stuck rank(s), node and phase, and what the others wait in,
by these rules, in order:

1. a rank whose heartbeat stopped (no update for `STALE_S`) is frozen: SIGSTOP, a GPU fault,
   swapping (on the reporter's own node the process state from /proc says which);
2. else the ranks outside a collective (`data`, `forward`, `optimizer`) while others wait in
   one (`backward`'s all-reduce, the stop `vote`, `eval`, `checkpoint`);
3. else every rank is in a collective: the ones at another step or phase than the rest took
   another branch (a skipped collective); all in the same one: a deadlock inside it.

Then the reporter exits `EXIT_HANG` (124), and the other ranks that saw the flag a few seconds
later (a rank stuck in a collective would otherwise sit out its stop grace period): the attempt
ends, and torchrun (or the target) restarts the group, counted against `restarts`. A frozen
(SIGSTOPped) rank cannot exit: its launcher kills it after the stop grace period
(`DDPKIT_STOP_GRACE_S`, torchrun's `--shutdown-timeout`); before that, a live rank of its
node writes the frozen rank's stacks, read from outside by py-spy. If the store itself stops answering
for `STORE_TIMEOUT_S` (its host, node rank 0, is frozen, dead or cut off: a node that died with
its link down sends no reset), the rank that notices says so and exits the same way; a reset
connection (the host's processes are gone) is left to the launcher, which sees that failure
itself. The deadline is the watchdog's own (a second thread times every store call): torch's
TCPStore client (2.13) logs its own timeout, then retries the request without end.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from trainer.contract import EXIT_HANG, HANG_VERDICT_PREFIX

#: Phases in which a rank waits for the others (a collective); the rest are its own work.
#: `collective` and `script`: a script's phases (trainer/script_watch.py, read from its stack).
COLLECTIVE = {"backward", "vote", "eval", "checkpoint", "rendezvous", "checkpoint_load", "collective"}
STEP_PHASES = {"data", "forward", "backward", "optimizer", "log", "vote", "collective", "script"}  # log: after a step
PUBLISH_EVERY_S = 1.0
STALE_S = 8.0
DUMP_WAIT_S = 3.0
WARM_STEPS = 5
STORE_TIMEOUT_S = 10.0
PEER_CHECK_EVERY_S = 2.0
PREFIX = HANG_VERDICT_PREFIX


class Heartbeat:
    """Where this rank's main thread is: written by the main thread, read by the watchdog."""

    def __init__(self) -> None:
        self.phase, self.step, self.since = "setup", 0, time.time()
        self.step_times: deque[float] = deque(maxlen=512)
        self.longest: dict[str, float] = {}  # checkpoint, eval: the longest so far
        self._step_t0: float | None = None
        # Seconds per phase since the last step's end, and the last step's (trainer/stragglers.py)
        self.phase_s: dict[str, float] = {}
        self.last_step: tuple[float, dict[str, float]] | None = None
        self._mark = self.since  # where phase_s has booked up to

    def beat(self, phase: str, step: int | None = None) -> None:
        now = time.time()
        if self.phase in ("checkpoint", "eval") and phase != self.phase:
            self.longest[self.phase] = max(self.longest.get(self.phase, 0.0), now - self.since)
        self.phase_s[self.phase] = self.phase_s.get(self.phase, 0.0) + now - self._mark
        self.phase, self.since, self._mark = phase, now, now
        if step is not None:
            self.step = step

    def rebook(self, phase: str, seconds: float) -> None:
        """The last `seconds` of the current phase were `phase` (stragglers: backward's tail
        spent waiting in the all-reduce); the watchdog's view is unchanged."""
        now = time.time()
        seconds = max(0.0, min(seconds, now - self._mark))
        self.phase_s[self.phase] = self.phase_s.get(self.phase, 0.0) + now - self._mark - seconds
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        self._mark = now

    def step_done(self) -> None:
        """An optimizer step ended: its time (for the deadlines) and its seconds per phase
        (`last_step`; the phase goes on, booked to the next step from now)."""
        now = time.time()
        self.phase_s[self.phase] = self.phase_s.get(self.phase, 0.0) + now - self._mark
        self._mark = now
        if self._step_t0 is not None:
            self.step_times.append(now - self._step_t0)
            self.last_step = (now - self._step_t0, self.phase_s)
        self.phase_s = {}
        self._step_t0 = now

    def deadline(self, floor_s: float, factor: float, timeout_s: float) -> float:
        if self.phase in STEP_PHASES:
            if len(self.step_times) < WARM_STEPS:
                return timeout_s
            times = sorted(self.step_times)
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            return max(floor_s, factor * p99)
        if self.phase in self.longest:
            return max(floor_s, factor * self.longest[self.phase])
        return timeout_s

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "step": self.step, "since": self.since, "t": time.time(),
                "host": socket.gethostname(), "pid": os.getpid()}


def store_client(timeout_s: float = STORE_TIMEOUT_S) -> Any:
    """A second client of the job's c10d store (MASTER_ADDR:MASTER_PORT, as env:// uses it)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def process_state(pid: int) -> str | None:
    """`T (stopped)`, `S (sleeping)`, ... from /proc, for a process on this node."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def verdict(beats: dict[int, dict[str, Any] | None], now: float, world: int) -> dict[str, Any]:
    """The culprit(s) and the others' wait from every rank's last heartbeat (the rules above)."""
    here = socket.gethostname()
    missing = [r for r in range(world) if beats.get(r) is None]
    stale = sorted(missing + [r for r, b in beats.items() if b and now - b["t"] > STALE_S])
    fresh = {r: b for r, b in beats.items() if b and r not in stale}
    if stale:
        def how(rank: int) -> str:
            b = beats.get(rank)
            if b is None:
                return f"rank {rank}: no heartbeat at all"
            state = process_state(b["pid"]) if b["host"] == here else None
            return (f"rank {rank} on {b['host']} (pid {b['pid']}) stopped answering {now - b['t']:.0f}s ago "
                    f"in {b['phase']} at step {b['step']}" + (f"; process state {state}" if state else ""))
        return {"cause": "frozen", "culprits": stale, "explain": "; ".join(map(how, stale)) +
                " (SIGSTOP, a GPU fault or swapping: alive but not running)", "others": _others(fresh)}
    outside = sorted(r for r, b in fresh.items() if b["phase"] not in COLLECTIVE)
    if outside and len(outside) < len(fresh):
        return {"cause": "stuck-outside-collective", "culprits": outside,
                "explain": "; ".join(f"rank {r} on {fresh[r]['host']} in {fresh[r]['phase']} at step "
                                     f"{fresh[r]['step']} for {now - fresh[r]['since']:.0f}s{_at(fresh[r])}"
                                     for r in outside),
                "others": _others({r: b for r, b in fresh.items() if r not in outside})}
    places = {(b["phase"], b["step"]) for b in fresh.values()}
    if len(places) > 1:
        counts: dict[tuple, list[int]] = {}
        for r, b in fresh.items():
            counts.setdefault((b["phase"], b["step"]), []).append(r)
        odd = min(counts.values(), key=len)
        return {"cause": "mismatched-collectives", "culprits": sorted(odd),
                "explain": "ranks wait in different collectives (one took another branch?): " + _others(fresh),
                "others": _others(fresh)}
    phase, step = places.pop() if places else ("?", 0)
    return {"cause": "deadlock", "culprits": sorted(fresh),
            "explain": f"every rank waits in {phase} at step {step}: a collective that never completes",
            "others": _others(fresh)}


def _at(beat: dict[str, Any]) -> str:
    """` at train.py:88 in main`: the rank's own line, where its heartbeat says (scripts)."""
    return f" at {beat['where']}" if beat.get("where") else ""


def _others(beats: dict[int, dict[str, Any]]) -> str:
    groups: dict[tuple, list[int]] = {}
    for r, b in sorted(beats.items()):
        groups.setdefault((b["phase"], b["step"]), []).append(r)
    return ", ".join(f"ranks {','.join(map(str, rs))} in {phase} at step {step}" if len(rs) > 1 else
                     f"rank {rs[0]} in {phase} at step {step}{_at(beats[rs[0]])}"
                     for (phase, step), rs in groups.items())


class Watchdog:
    """One rank's watchdog thread (see the module docstring). `start` after the process group
    exists; `stop` before it is destroyed."""

    def __init__(self, heartbeat: Heartbeat, *, rank: int, world: int, attempt: int, debug_dir: Path,
                 floor_s: float, factor: float, timeout_s: float, on_hang: Any = None) -> None:
        self.hb, self.rank, self.world, self.attempt = heartbeat, rank, world, attempt
        self.debug_dir = debug_dir
        self.floor_s, self.factor, self.timeout_s = floor_s, factor, timeout_s
        self.on_hang = on_hang  # rank 0: book the hang in the ledger before the exit
        self.flag = f"ddpkit/hang/{attempt}"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)
        self.dumped = False
        self.fired = False  # this attempt's hang flag was raised (here or by another rank)
        self.store_call_since: float | None = None  # when the store call in progress began
        self.peer_check_at = 0.0  # when `_next_rank_lost` asks the store next

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()

    def _key(self, rank: int) -> str:
        return f"ddpkit/hb/{self.attempt}/{rank}"

    def _run(self) -> None:
        threading.Thread(target=self._time_the_store, name="ddpkit-watchdog-store", daemon=True).start()
        try:
            store = _TimedStore(self, self._timed(store_client))
        except Exception as e:  # noqa: BLE001  (no watchdog is better than a failed run)
            print(f"ddpkit watchdog: off on rank {self.rank}: cannot reach the store ({e})", file=sys.stderr)
            return
        while not self.done.is_set():
            try:
                self._tick(store)
            except Exception as e:  # noqa: BLE001  (the store host is gone or frozen)
                # After another rank's verdict (its exit takes the store with it when it is
                # rank 0) there is nothing new to say: the launcher ends this process.
                # A refused or reset connection: the store's host (rank 0) is gone, and its
                # launcher sees that failure; only a store that stops answering is a hang.
                if not (self.done.is_set() or self.dumped) and "timeout" in str(e).lower():
                    self._store_lost(e)
                return
            self.done.wait(PUBLISH_EVERY_S)

    def _timed(self, call: Any, *args: Any) -> Any:
        """`call(*args)`, a store call, with `_time_the_store` watching its duration."""
        self.store_call_since = time.time()
        try:
            return call(*args)
        finally:
            self.store_call_since = None

    def _time_the_store(self) -> None:
        """A store call of this rank's watchdog that has not returned in `STORE_TIMEOUT_S`: the
        store's host does not answer, so this rank says so and leaves (the calling thread stays
        blocked in torch's retries)."""
        while not self.done.wait(1.0):
            since = self.store_call_since
            if since is not None and time.time() - since > STORE_TIMEOUT_S:
                self._store_lost(TimeoutError(f"no answer in {time.time() - since:.0f}s"))
                return

    def _tick(self, store: Any) -> None:
        store.set(self._key(self.rank), json.dumps(self.hb.as_dict()))
        if store.check([self.flag]):  # another rank found the hang: stacks, then out
            self.fired = True
            self._dump()
            self._book({"age_s": time.time() - self.hb.since})
            # the reporter reads the heartbeats and exits first; its verdict goes to this
            # node's log too (a cluster may keep only some nodes' logs: a Kubernetes Job that
            # fails deletes its other pods). The reporter posts it after DUMP_WAIT_S and its
            # own bookkeeping, which a loaded node or a pod's CPU quota can stretch: wait as
            # long as a store call may take on top (a verdict there ends the wait at once).
            deadline = time.time() + DUMP_WAIT_S + STORE_TIMEOUT_S
            while time.time() < deadline:
                with contextlib.suppress(Exception):
                    if store.check([self.flag + "/verdict"]):
                        found = json.loads(store.get(self.flag + "/verdict"))
                        if os.environ.get("LOCAL_RANK", "0") == "0" and found.get("host") != socket.gethostname():
                            print(PREFIX + json.dumps(found), flush=True)  # once a node, not the reporter's
                        break
                time.sleep(0.2)
            leave()
        age = time.time() - self.hb.since
        if age > self.hb.deadline(self.floor_s, self.factor, self.timeout_s) or self._next_rank_lost(store, age):
            self.fired = True
            if store.add(self.flag, 1) == 1:  # the first to see it reports
                self._report(store, age)
            self._dump()

    def _next_rank_lost(self, store: Any, age: float) -> bool:
        """Waiting in a collective for over `floor_s`: has the next rank (a ring: each rank asks
        about one other, once every `PEER_CHECK_EVERY_S`) stopped publishing its heartbeat for
        over `floor_s`? Its watchdog thread stops only with the process: it is frozen, dead, or
        its node is gone (link down: no reset reaches the others). Without this a rank lost
        before `WARM_STEPS` steps or in the first checkpoint, whose deadline is the collective
        timeout, would hold the others for `timeout_s`. A rank that never published is left to
        the deadlines."""
        now = time.time()
        if self.world < 2 or self.hb.phase not in COLLECTIVE or age < self.floor_s or now < self.peer_check_at:
            return False
        self.peer_check_at = now + PEER_CHECK_EVERY_S
        key = self._key((self.rank + 1) % self.world)
        if not store.check([key]):
            return False
        return now - json.loads(store.get(key))["t"] > max(self.floor_s, STALE_S)

    def _dump(self) -> None:
        if self.dumped:
            return
        self.dumped = True
        path = self._write_stacks()
        print(f"ddpkit watchdog: rank {self.rank}: stacks in {path}", file=sys.stderr, flush=True)
        for rank, pid in stopped_siblings():
            dump_from_outside(rank, pid, self.debug_dir, self.attempt)

    def _write_stacks(self) -> Path:
        """This rank's stacks, every thread, in `debug_dir/rank-R.txt`."""
        self.debug_dir.mkdir(parents=True, exist_ok=True)
        path = self.debug_dir / f"rank-{self.rank}.txt"
        # there already: read from outside while this rank was stopped (dump_from_outside), and
        # it runs again (Slurm's kill sequence sends SIGCONT before SIGTERM): both are kept
        again = path.exists()
        with path.open("a" if again else "w") as fh:
            if again:
                fh.write("\n--- then it ran again (SIGCONT) and wrote its own:\n")
            fh.write(f"rank {self.rank} on {socket.gethostname()} (pid {os.getpid()}), attempt {self.attempt}, "
                     f"in {self.hb.phase} at step {self.hb.step} for {time.time() - self.hb.since:.1f}s\n\n")
            fh.flush()
            faulthandler.dump_traceback(fh, all_threads=True)
        return path

    def _report(self, store: Any, age: float) -> None:
        self._dump()
        time.sleep(DUMP_WAIT_S)
        now = time.time()
        beats: dict[int, dict[str, Any] | None] = {self.rank: self.hb.as_dict()}  # this rank is alive
        for r in range(self.world):
            with contextlib.suppress(Exception):  # a rank that never published: missing
                if r != self.rank and store.check([self._key(r)]):
                    beats[r] = json.loads(store.get(self._key(r)))
        found = {"attempt": self.attempt, "reporter": self.rank, "host": socket.gethostname(), "age_s": round(age, 1),
                 **verdict(beats, now, self.world), "debug_dir": str(self.debug_dir)}
        self._finish(found, store)

    def _store_lost(self, err: Exception) -> None:
        self._dump()
        self._finish({"attempt": self.attempt, "reporter": self.rank, "cause": "frozen", "culprits": [0],
                      "explain": f"the job's store on {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                                 f"does not answer ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else '-'}): node rank 0, its host, is "
                                 "frozen, gone or cut off",
                      "others": f"rank {self.rank} in {self.hb.phase} at step {self.hb.step}",
                      "debug_dir": str(self.debug_dir)})

    def _finish(self, found: dict[str, Any], store: Any = None) -> None:
        found.setdefault("time", round(time.time(), 3))  # when it was said (the launcher's verdicts have it too)
        line = (f"hang: {found['explain']}; waiting: {found['others']}. Stacks: {found['debug_dir']}/. "
                f"Ending attempt {self.attempt} (exit {EXIT_HANG}): the group restarts if restarts are left")
        with contextlib.suppress(OSError):
            self.debug_dir.mkdir(parents=True, exist_ok=True)
            (self.debug_dir / "verdict.txt").write_text(json.dumps(found, indent=1) + "\n" + line + "\n")
        print(PREFIX + json.dumps(found), flush=True)
        print(f"ddpkit watchdog: {line}", file=sys.stderr, flush=True)
        self._book(found)  # first: the others leave once they read the verdict below
        if store is not None:  # for the other nodes' logs (they wait for it after the flag)
            with contextlib.suppress(Exception):
                store.set(self.flag + "/verdict", json.dumps(found))
                time.sleep(1.0)
        leave()

    def _book(self, found: dict[str, Any]) -> None:
        """Rank 0 books the hang in its ledger and writes the attempt's last record, once."""
        if self.on_hang is not None:
            on_hang, self.on_hang = self.on_hang, None
            with contextlib.suppress(Exception):
                on_hang(found)


def stopped_siblings() -> list[tuple[int, int]]:
    """(rank, pid) of this node's other ranks that are stopped (SIGSTOP, a debugger): the
    processes beside this one under the same launcher, in state T or t."""
    found = []
    me, parent = os.getpid(), str(os.getppid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            if ppid != parent or int(pid) == me or state not in ("T", "t"):
                continue
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm.startswith("ddpkit-rank"):  # forked by the warm template (trainer/warm.py)
                found.append((int(comm.removeprefix("ddpkit-rank")), int(pid)))
                continue
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
            if "RANK" in env:  # a worker torchrun started: its environment from exec
                found.append((int(env["RANK"]), int(pid)))
    return sorted(found)


def dump_from_outside(rank: int, pid: int, debug_dir: Path, attempt: int) -> None:
    """`rank-R.txt` of a stopped rank, which cannot run faulthandler itself: its Python stacks
    read from outside by py-spy (`dump --nonblocking`: the process is not touched), written once
    per node (the first live rank there to get to it), or why there are none."""
    import shutil
    import subprocess

    try:
        fh = (debug_dir / f"rank-{rank}.txt").open("x")
    except OSError:  # another rank of this node wrote it
        return
    with fh:
        fh.write(f"rank {rank} on {socket.gethostname()} (pid {pid}), attempt {attempt}: stopped "
                 f"({process_state(pid)}); its stacks read from outside by py-spy\n\n")
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        try:
            out = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                                 text=True, timeout=20)
            fh.write(out.stdout + out.stderr)
        except (OSError, subprocess.TimeoutExpired) as e:
            fh.write(f"no stacks: py-spy could not run ({e}); pip install py-spy (the image has it)\n")


class _TimedStore:
    """A store whose every call the watchdog times (`Watchdog._timed`)."""

    def __init__(self, watchdog: Watchdog, store: Any) -> None:
        self._watchdog, self._store = watchdog, store

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)
        return lambda *args: self._watchdog._timed(call, *args)


def leave() -> None:
    """End this rank now, with `EXIT_HANG`, and its children first: a DataLoader worker stuck in
    the user's code would outlive it (os._exit runs no cleanup), holding the job's output open."""
    import signal

    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                os.kill(int(pid), signal.SIGKILL)
    os._exit(EXIT_HANG)
