"""`ddpkit why HANDLE` (or a local run's directory): why a job ended as it did, in one line,
then the details per attempt.

    exception: rank 1 on node2, attempt 0: ValueError: loss is nan (train.py:880 in train_step, step 41, in forward)

The first line is `CATEGORY: rank R on NODE, attempt N: EVIDENCE`, with CATEGORY one of
`CATEGORIES` (the rank, node or attempt left out where nothing says). It comes from what each
attempt leaves in the run directory (trainer/attempts.py: a worker's exception, the failed
workers torchrun reported with their exit codes and signals, the hang watchdog's verdict, rank
0's progress record) and, on a cluster, from the scheduler's own words (`ddpkit status`'s
state line: Slurm's state and reason, the pods' conditions) and the job's log (the same torchrun
and watchdog lines, read from the output file or rank 0's pod). The cause of a run is the cause
of its last attempt; earlier attempts follow as details.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.attempts import (
    ATTEMPTS_DIR,
    ERRORS_DIR,
    FAILED_WORKER,
    LAUNCH_DIR,
    OOM_LINE,
    PEER_GONE,
    read_records,
    read_verdicts,
    signal_name,
)
from trainer.contract import (
    EXIT_BAD_CONFIG,
    EXIT_HANG,
    EXIT_OK,
    HANG_VERDICT_PREFIX,
    parse_workdir_line,
    read_node_line_tag,
    workdir_line,
)
from trainer.progress import attempt_files, last_record, read_record

#: The causes `why` names, in the words of its first line.
CATEGORIES = {
    "completed": "the run finished",
    "running": "no failure yet: the job is still running or waiting",
    "stopped": "stopped on request (a signal, preemption, `ddpkit cancel`) after a checkpoint",
    "hang": "a rank stopped making progress (the hang watchdog's verdict)",
    "exception": "a Python exception on a rank",
    "killed": "a rank was killed by a signal (SIGKILL: the OOM killer or kill -9)",
    "oom": "out of memory (the scheduler says so: OOMKilled, OUT_OF_MEMORY)",
    "config": "the job file or a setting was refused when the run started",
    "rendezvous": "the ranks could not meet: the master's name or port (DNS, a port in use, a timeout)",
    "node-lost": "a node failed or was lost",
    "preempted": "preempted by the scheduler",
    "time-limit": "the job reached its time limit",
    "cancelled": "cancelled",
    "queued": "waiting to be scheduled or admitted",
    "unschedulable": "no node can take a pod (resources, selectors, taints)",
    "image": "the container image cannot be pulled or started",
    "mount": "a volume cannot be mounted",
    "disk-full": "a disk or quota is full (ENOSPC, EDQUOT): a checkpoint or log could not be written",
    "failed": "the job failed, and no record says how (see the log)",
}
_TERM = {"SIGTERM"}  # what torchrun sends the rest of a group once one worker failed


@dataclass
class Cause:
    category: str
    evidence: str
    rank: int | None = None
    node: str | None = None
    attempt: int | None = None

    def line(self) -> str:
        where = [f"rank {self.rank}" if self.rank is not None else None,
                 f"on {self.node}" if self.node else None,
                 f"attempt {self.attempt}" if self.attempt is not None else None]
        said = " ".join(w for w in where[:2] if w)
        said = ", ".join(w for w in (said, where[2]) if w)
        return f"{self.category}: {said}: {self.evidence}" if said else f"{self.category}: {self.evidence}"


# -- a run directory (local runs; on a cluster, where the submitting host can read it) ---------

@dataclass
class Attempt:
    number: int
    started: float
    record: dict[str, Any] | None


def attempts_of(run_dir: Path, launches: list[float]) -> list[Attempt]:
    """The recorded attempts, and one more when a node's launcher started (`launches`: times)
    after the last one had ended: a start that failed before rank 0 wrote its record (a
    checkpoint refused while resuming, a rendezvous that never formed). The same launcher's
    teardown after a failure belongs to the attempt that failed."""
    out = []
    for path in attempt_files(run_dir):
        record = read_record(path)
        if record and "started" in record:
            out.append(Attempt(int(record.get("attempt", len(out))), float(record["started"]), record))
    last = out[-1].record if out else None
    if last and last.get("state") != "running":
        later = [t for t in launches if t > float(last.get("updated", 0.0))]
        if later:
            out.append(Attempt(out[-1].number + 1, min(later), None))
    return out


def attempt_at(attempts: list[Attempt], t: float) -> int | None:
    """The attempt an event at time `t` belongs to: the last one started by then (an event
    before the first record, during startup, belongs to the first)."""
    if not attempts:
        return None
    started = [a for a in attempts if a.started <= t]
    return (started[-1] if started else attempts[0]).number


def run_dir_causes(run_dir: Path) -> list[Cause]:
    """One cause per attempt, oldest first, from the run directory's records."""
    verdicts = read_verdicts(run_dir)
    errors = read_records(run_dir / ATTEMPTS_DIR / ERRORS_DIR)
    launches = read_records(run_dir / ATTEMPTS_DIR / LAUNCH_DIR)
    failures = [dict(f, host=launch["host"], oom_kills=launch.get("oom_kills"))
                for launch in launches for f in launch.get("failures", [])]
    attempts = attempts_of(run_dir, [x["started"] for x in launches])
    # the ranks the launchers started (nodes that wrote a record x their processes)
    hosts = {r: x.get("host") for x in launches for r in range(int(x.get("node_rank") or 0) * int(x.get("nproc") or 1),
                                                                (int(x.get("node_rank") or 0) + 1) * int(x.get("nproc") or 1))}
    # a script job writes no progress record: its attempts are the ones its stacks name
    numbers = [a.number for a in attempts] or sorted(verdicts)[-1:] or [0]
    causes = []
    for n in numbers:
        mine_errors = [e for e in errors if (attempt_at(attempts, e["time"]) or 0) == n]
        mine_failures = [f for f in failures if (attempt_at(attempts, f["time"]) or 0) == n]
        record = next((a.record for a in attempts if a.number == n), None)
        cause = attempt_cause(n, record, verdicts.get(n), mine_errors, mine_failures, hosts)
        if cause.category == "failed" and not (mine_errors or mine_failures):  # no worker said: the launchers
            mine = [x for x in launches if (attempt_at(attempts, x.get("ended", 0.0)) or 0) == n]
            cause = launch_cause(mine, n) or cause
        causes.append(cause)
    return causes


def launch_cause(launches: list[dict[str, Any]], n: int) -> Cause | None:
    """Why an attempt ended when no worker said: a launcher that refused to start (the job's
    settings, the master never answered), or torchrun ending with no worker failed (its
    rendezvous): the launcher's words, or its last lines read as a log. A script job keeps no
    progress record: every node's launcher ending 0 is its completion."""
    for x in launches:
        if x.get("refused"):
            category = "config" if x.get("exit") == EXIT_BAD_CONFIG else "rendezvous"
            return Cause(category, x["refused"], node=x.get("host"), attempt=n)
    for x in launches:
        if x.get("torchrun_exit") not in (None, 0):
            tail = "\n".join(x.get("tail") or [])
            cause = log_cause(tail) or Cause("failed", f"torchrun exit {x['torchrun_exit']}: "
                                             f"{next((t for t in reversed(x.get('tail') or []) if t.strip()), '')}")
            cause.node, cause.attempt = cause.node or x.get("host"), n
            return cause
    if launches and all(x.get("exit") == EXIT_OK for x in launches):
        nodes = sorted({x.get("node_rank") or 0 for x in launches})
        return Cause("completed", f"every worker exited 0 (torchrun on {len(nodes)} node(s))", attempt=n)
    return None


def attempt_cause(n: int, record: dict[str, Any] | None, verdict: dict[str, Any] | None,
                  errors: list[dict[str, Any]], failures: list[dict[str, Any]],
                  hosts: dict[int, str] | None = None) -> Cause:
    """Why attempt `n` ended, in this order: the watchdog's verdict; a worker's own exception;
    a worker killed by a signal (not the SIGTERM torchrun sends the rest of the group); an
    exception that only says a peer went away (the consequence of the one that died); the
    first worker torchrun saw fail; the progress record's state."""
    if verdict and verdict.get("cause") == "stopped":  # a script job's stop (trainer/guard.py)
        return Cause("stopped", f"{verdict.get('explain')}; stacks in {verdict.get('debug_dir')}/", attempt=n)
    if verdict:
        cause = verdict_cause(verdict)
        cause.evidence, cause.attempt = f"{cause.evidence}; the others: {verdict.get('others')}", n
        return cause
    own = [e for e in errors if not PEER_GONE.search(f"{e.get('type')}: {e.get('message')}")]
    timed_out = [e for e in own if _COLLECTIVE_TIMEOUT.search(f"{e.get('type')}: {e.get('message')}")]
    if own and len(timed_out) == len(own):  # they waited for a rank that said nothing: the culprit
        return timeout_cause(timed_out, failures, hosts or {}, n)
    if own:
        return exception_cause(own[0], n)
    said = {e.get("rank") for e in errors}  # ranks that left an exception (a peer's, here)
    ended = [f for f in failures if f.get("signal") not in _TERM]
    first = (next((f for f in ended if f.get("signal")), None)  # killed
             or next((f for f in ended if f.get("rank") not in said), None))  # ended without a word
    if first is not None:
        return failure_cause(first, n)
    state = (record or {}).get("state")
    if state == "completed":
        return Cause("completed", f"step {_step(record)}{_skipped(record)}", attempt=n)
    if state == "stopped":  # the workers' stop exits (143 after SIGTERM) are no failure
        return Cause("stopped", f"after the checkpoint of step {record.get('step')}{_skipped(record)}", attempt=n)
    if errors:
        return exception_cause(errors[0], n)
    if failures:
        return failure_cause(failures[0], n)
    if state == "running":
        return Cause("running", f"at step {_step(record)}", attempt=n)
    return Cause("failed", f"attempt record says {state!r}, and no worker failure was recorded", attempt=n)


def _step(record: dict[str, Any]) -> str:
    """`40/100`, or `40` where the total is not known (a script job without `steps:`)."""
    total = record.get("total_steps")
    return f"{record.get('step')}/{total}" if total else f"{record.get('step')}"


def timeout_cause(timed_out: list[dict[str, Any]], failures: list[dict[str, Any]], hosts: dict[int, str],
                  n: int | None) -> Cause:
    """Ranks whose collective timed out (`train.timeout_s`, the watchdog off): the ranks that
    did not time out (torchrun ended them afterwards) are the ones they waited for."""
    waited = sorted({e.get("rank") for e in timed_out if e.get("rank") is not None})
    quiet = sorted(({f.get("rank") for f in failures} | set(hosts)) - set(waited) - {None})
    e = timed_out[0]
    where = (f" in {e['phase']}" if e.get("phase") else "") + (f" at step {e['step']}" if e.get("step") is not None else "")
    said = (f"collective timeout: rank(s) {','.join(map(str, waited))} waited{where} "
            f"({e['type']}: {str(e['message']).splitlines()[0][:200]})")
    said += (f"; rank(s) {','.join(map(str, quiet))} never joined (no error of their own)" if quiet else
             "; every rank waited (a deadlock)")
    return Cause("hang", said, quiet[0] if quiet else None, hosts.get(quiet[0]) if quiet else None, n)


def _skipped(record: dict[str, Any]) -> str:
    """A resume that skipped unusable checkpoints (corrupt, truncated): which, and from where."""
    resumed = record.get("resumed") or {}
    skipped = resumed.get("skipped") or []
    if not skipped:
        return ""
    start = f"resumed from step {resumed['step']}" if resumed.get("step") is not None else "started from step 0"
    return f"; {start}, checkpoints skipped: " + ", ".join(
        f"{Path(x['path']).name} ({x['problem']})" for x in skipped)


#: an error that says a disk is full (ENOSPC) or a quota is reached (EDQUOT)
_DISK_FULL = re.compile(r"No space left on device|Errno 28\b|ENOSPC|Disk quota exceeded|Errno 122\b")
#: a collective or the store timed out (gloo's, NCCL's and c10d's words)
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Watchdog caught collective operation timeout|"
                                 r"DistTimeoutError|wait timeout after \d+ms")


def exception_cause(e: dict[str, Any], n: int | None) -> Cause:
    said = f"{e.get('type')}: {e.get('message')}"
    category = ("config" if e.get("type") == "ConfigError" else "disk-full" if _DISK_FULL.search(said)
                else "exception")
    at = f" at {e['where']}" if e.get("where") else ""
    step = f", step {e['step']}" if e.get("step") is not None else ""
    phase = f", in {e['phase']}" if e.get("phase") else ""
    return Cause(category, f"{e['type']}: {e['message']}{at}{step}{phase}".strip(), e.get("rank"), e.get("host"), n)


def failure_cause(f: dict[str, Any], n: int | None) -> Cause:
    code, sig = f.get("exitcode"), f.get("signal")
    if sig == "SIGKILL" and f.get("oom_kills"):  # the kernel counted it in the launcher's cgroup
        return Cause("oom", f"exit {code} (SIGKILL by the OOM killer: {f['oom_kills']} kill(s) in the "
                     "node's memory cgroup while this attempt ran)", f.get("rank"), f.get("host"), n)
    if sig:
        return Cause("killed", f"exit {code} ({sig}: the OOM killer, kill -9 or the node's limits)"
                     if sig == "SIGKILL" else f"exit {code} ({sig})", f.get("rank"), f.get("host"), n)
    if code == EXIT_HANG:
        return Cause("hang", f"exit {code}: the hang watchdog ended the attempt", f.get("rank"), f.get("host"), n)
    if code == EXIT_BAD_CONFIG:
        return Cause("config", f"exit {code}: a setting was refused (the rank's output says which)",
                     f.get("rank"), f.get("host"), n)
    return Cause("exception" if code == 1 else "failed", f"exit {code}", f.get("rank"), f.get("host"), n)


# -- a log's text (a Slurm job's output file, a pod's log) ---------------------------------------

_HANG = re.compile(re.escape(HANG_VERDICT_PREFIX) + r"(\{.*\})")
_EXCEPTION = re.compile(r"^(?:\[\w+\d+\]:)?\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")
_BAD_CONFIG = re.compile(r"(bad job file.*|train\.[\w.]+: .+|script .+: no such file.*)")
#: The rendezvous failing in torch's, c10d's and the launcher's words: a port in use, a name
#: that does not resolve, a master that never answered.
_RENDEZVOUS = re.compile(r"EADDRINUSE|[Aa]ddress already in use|Name or service not known|"
                         r"Temporary failure in name resolution|nodename nor servname|"
                         r"RendezvousTimeoutError|RendezvousConnectionError|master .* did not (answer|resolve)")
_RENDEZVOUS_WHY = re.compile(r"EADDRINUSE|[Aa]ddress already in use|Name or service not known|"
                             r"Temporary failure in name resolution|nodename nor servname|does not resolve")


def verdict_cause(verdict: dict[str, Any]) -> Cause:
    """The hang watchdog's verdict (or trainer/guard.py's, for a script job): the first culprit
    and the node its explanation names."""
    if verdict.get("cause") == "stopped":
        return Cause("stopped", verdict.get("explain", ""))
    culprit = (verdict.get("culprits") or [None])[0]
    node = re.search(rf"rank {culprit}:? on (\S+?)[ ,;:]", verdict.get("explain", "")) if culprit is not None else None
    return Cause("hang", verdict.get("explain", ""), culprit, node.group(1) if node else None)


def _untagged(line: str) -> tuple[str, int | None, int | None]:
    """A log line without the launcher's `[NODE/RANK] ` tag (Slurm, `run --local`), and the
    node rank and worker rank the tag names."""
    tag = read_node_line_tag(line)
    return (line[tag[2]:], tag[0], tag[1]) if tag else (line, None, None)


def log_cause(text: str) -> Cause | None:
    """The cause a log shows (None when it shows none): the watchdog's verdict, else the first
    failed worker torchrun reported (with the exception printed before it, and the node rank
    its tag names), else a refused setting."""
    tagged = [_untagged(line) for line in text.splitlines()]
    lines = [line for line, _, _ in tagged]
    for line in lines:
        found = _HANG.search(line)
        if found:
            try:
                verdict = json.loads(found.group(1))
            except ValueError:
                continue
            return verdict_cause(verdict)
    raised = [(j, m) for j, line in enumerate(lines) if (m := _EXCEPTION.match(line))]
    failed = [(i, int(f.group(1)), int(f.group(2))) for i, line in enumerate(lines)
              if (f := FAILED_WORKER.search(line))]
    if failed:
        # the rank's own exception first; a peer's "connection closed" is the consequence
        own = [(j, m) for j, m in raised if not PEER_GONE.search(m.group(0))]
        killed = [f for f in failed if signal_name(f[1]) and signal_name(f[1]) not in _TERM]
        if own or not killed:
            j, m = (own or raised or [(None, None)])[0]
            if m is not None:
                code = next((c for i, c, _ in failed if i > j and tagged[i][1] == tagged[j][1]), None)
                node, rank = tagged[j][1], tagged[j][2]
                if _COLLECTIVE_TIMEOUT.search(m.group(0)) and all(_COLLECTIVE_TIMEOUT.search(x.group(0)) for _, x in own):
                    return Cause("hang", f"collective timeout: {m.group(1)}: {m.group(2)}", None,
                                 f"node {node}" if node is not None else None)
                return Cause("exception", f"{m.group(1)}: {m.group(2)}" + (f" (exit {code})" if code is not None else ""),
                             rank, f"node {node}" if node is not None else None)
        i, code, local = (killed or failed)[0]
        ooms = sum(1 for line in lines if OOM_LINE in line)
        cause = failure_cause({"exitcode": code, "signal": signal_name(code), "local_rank": local,
                               "oom_kills": ooms}, None)
        cause.node = f"node {tagged[i][1]}" if tagged[i][1] is not None else None
        return cause
    for line in lines:
        found = _BAD_CONFIG.search(line)
        if found:
            return Cause("config", found.group(1).strip())
    said = [line for line in lines if _RENDEZVOUS.search(line)]
    if said:  # the line that says why (a port, a name) over the one that only raises
        return Cause("rendezvous", next((x for x in said if _RENDEZVOUS_WHY.search(x)), said[0]).strip()[:500])
    return None


# -- the scheduler's words: the state line of `ddpkit status` --------------------------------------

_STATE_WORDS = (  # (what the state line says, category), first match wins
    ("OUT_OF_MEMORY", "oom"), ("OOMKilled", "oom"), ("NODE_FAIL", "node-lost"), ("NodeLost", "node-lost"),
    ("NotReady", "node-lost"), ("PREEMPTED", "preempted"), ("Preempted", "preempted"), ("Evicted", "preempted"),
    ("TIMEOUT", "time-limit"), ("DeadlineExceeded", "time-limit"), ("ImagePull", "image"),
    ("ErrImage", "image"), ("ContainerCannotRun", "image"), ("FailedMount", "mount"),
    ("Unschedulable", "unschedulable"),
)


#: how the scheduler says a job's script or step ended (deploy/slurm/submit.py, from sacct)
_ENDED_WITH = re.compile(r"exit code (\d+)|killed by signal \d+ \((SIG\w+)\)")
#: causes read from an exit code or signal alone: a run directory or a log says more
_FROM_EXIT = ("exception", "failed", "killed", "hang", "config")


def _unwrapped(detail: str) -> str:
    """`detail` without the parentheses the state line puts around it (`(a (b)) [c]` -> `a (b) [c]`)."""
    if not detail.startswith("("):
        return detail
    depth = 0
    for i, char in enumerate(detail):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return (detail[1:i] + detail[i + 1:]).strip()
    return detail[1:]


def state_cause(state_line: str) -> Cause | None:
    """The cause in the scheduler's own words, from `ddpkit status`'s state line."""
    state, _, detail = state_line.partition(" ")
    detail = _unwrapped(detail.strip())
    if state == "SUCCEEDED":
        return Cause("completed", detail or "the scheduler says the job completed")
    if state == "CANCELLED":
        return Cause("cancelled", detail or "cancelled")
    if state in ("PENDING", "QUEUED"):
        for word, category in _STATE_WORDS:
            if word in detail and category in ("unschedulable", "image", "mount"):
                return Cause(category, detail)
        return Cause("queued", detail or state)
    if state in ("RUNNING", "RESTARTING"):
        for word, category in _STATE_WORDS:
            if word in detail and category in ("unschedulable", "image", "mount", "node-lost"):
                return Cause(category, f"{state}: {detail}")
        return Cause("running", state_line)
    for word, category in _STATE_WORDS:
        if word in detail:
            return Cause(category, detail)
    ended = _ENDED_WITH.search(detail)
    if ended:
        code = int(ended.group(1)) if ended.group(1) else None
        return Cause(failure_cause({"exitcode": code, "signal": ended.group(2)}, None).category, detail)
    return None


def explain(state_line: str, log_text: str, run_dir: Path | None = None,
            workdir: dict | None = None) -> list[str]:
    """`ddpkit why`'s lines: the cause, then one line per attempt where the run directory is
    readable. The scheduler's words win for what only it knows (a lost node, the time limit,
    OOM, preemption, a pod never scheduled); the records and the log say which rank and how.
    Last, for a `workdir:` job, the tree it ran (`workdir`, else the records' or the log's)."""
    causes = run_dir_causes(run_dir) if run_dir is not None and (run_dir / ATTEMPTS_DIR).is_dir() else []
    said = state_cause(state_line) if state_line else None
    from_log = log_cause(log_text) if log_text else None
    last = causes[-1] if causes else None
    if said is not None and said.category not in ("completed", "running", "cancelled", *_FROM_EXIT):
        first = said
    elif last is not None and (last.category != "failed" or from_log is None):
        first = last
    else:
        first = from_log or said or Cause("failed", state_line or "no record and no log to read")
    if first is said and said.category == "completed":  # no run directory: the log's last record says how far
        record = last_record(log_text) if log_text else None
        if record and record.get("state") == "completed":
            first = Cause("completed", f"step {_step(record)}{_skipped(record)}", attempt=record.get("attempt"))
    lines = [first.line()]
    if len(causes) > 1 or (causes and first is not causes[-1]):
        lines += [f"  attempt {c.attempt}: {c.line()}" for c in causes]
    if state_line:
        lines.append(f"  scheduler: {state_line}")
    workdir = workdir or ran(run_dir) or (parse_workdir_line(log_text) if log_text else None)
    if workdir:
        lines.append(f"  {workdir_line(workdir)}")
    return lines


def ran(run_dir: Path | None) -> dict | None:
    """The tree a `workdir:` run ran, as its launchers recorded it (trainer/attempts.py)."""
    if run_dir is None or not (run_dir / ATTEMPTS_DIR).is_dir():
        return None
    found = [x["workdir"] for x in read_records(run_dir / ATTEMPTS_DIR / LAUNCH_DIR) if x.get("workdir")]
    return found[-1] if found else None
