"""What Slurm accounting (`sacct`) kept of a job slurmctld no longer knows: `ended(jobid)`.

`sacct --json` first (Slurm >= 21.08 built with the JSON serializer; Debian's 22.05 has it),
else `sacct -P` with the fields `why` needs. The JSON differs by release, and `Ended` hides it:

* 22.05 (openapi/dbv0.0.38): `state.current` a word, `exit_code.return_code` a number,
  `exit_code.signal.signal_id`, `time.limit` minutes as a number;
* 23.11 (data_parser v0.0.40) and 24.11 (v0.0.42): `state.current` a list of words, numbers as
  `{"set", "infinite", "number"}`, `exit_code.signal.id` such a number; 24.11 adds `restart_cnt`.

This module only reads text; deploy/slurm/submit.py runs sacct (`ended`) and maps Slurm's words
(STATES, _ENDED_BECAUSE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: the `sacct -P` fields read when `--json` is not there, in this order
PARSABLE_FIELDS = ("JobID", "State", "Reason", "ExitCode", "NodeList", "ElapsedRaw", "TimelimitRaw")


@dataclass(frozen=True)
class Step:
    id: str  # `12.batch`, `12.0`
    state: str
    exit_code: int | None = None
    signal: int | None = None


@dataclass(frozen=True)
class Ended:
    """One job as accounting kept it; `state` is Slurm's own word (FAILED, NODE_FAIL, ...)."""

    state: str
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    nodes: str = ""
    cancelled_by: str = ""  # a user name (JSON) or `uid N` (-P)
    restarts: int = 0
    elapsed_s: int | None = None
    limit_s: int | None = None
    failed_node: str = ""
    steps: tuple[Step, ...] = ()

    def killed_step(self) -> Step | None:
        """The first step a signal ended (SIGTERM at the time limit, SIGKILL of the OOM killer)."""
        return next((s for s in self.steps if s.signal), None)


class NotJson(ValueError):
    """sacct answered, but not with JSON it can be read as (no `--json` in this build)."""


# -- sacct --json ----------------------------------------------------------------------------

def from_json(text: str, jobid: str) -> Ended | None:
    """`sacct --json -j JOBID`'s answer, any of the three shapes; None when it has no such job."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise NotJson(f"sacct --json did not answer JSON: {text.strip()[:80]!r}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise NotJson("sacct --json answered JSON without a `jobs` list")
    job = next((j for j in doc["jobs"] if _is(j, jobid)), None)
    return None if job is None else _job(job)


def _is(job: dict[str, Any], jobid: str) -> bool:
    """`12` is job_id 12; an array task `34_2` is array.job_id 34, array.task_id 2."""
    array, _, task = jobid.partition("_")
    if not task:
        return str(job.get("job_id")) == jobid
    ids = job.get("array") or {}
    return (str(_number(ids.get("job_id"))), str(_number(ids.get("task_id")))) == (array, task)


def _job(job: dict[str, Any]) -> Ended:
    state = job.get("state") or {}
    code, signal = _exit(job.get("exit_code"))
    limit = _number((job.get("time") or {}).get("limit"))
    reason = str(state.get("reason") or "")
    return Ended(
        state=_word(state.get("current")), reason="" if reason == "None" else reason,
        exit_code=code, signal=signal, nodes=str(job.get("nodes") or ""),
        cancelled_by=str(job.get("kill_request_user") or ""),
        restarts=_number(job.get("restart_cnt")) or 0,
        elapsed_s=_number((job.get("time") or {}).get("elapsed")),
        limit_s=None if limit is None else limit * 60, failed_node=str(job.get("failed_node") or ""),
        steps=tuple(_step(s) for s in job.get("steps") or []))


def _step(step: dict[str, Any]) -> Step:
    code, signal = _exit(step.get("exit_code"))
    return Step(str((step.get("step") or {}).get("id", "")), _word(step.get("state")), code, signal)


def _exit(exit_code: Any) -> tuple[int | None, int | None]:
    """(return code, signal) from `exit_code`; 22.05 says `signal.signal_id`, later `signal.id`."""
    if not isinstance(exit_code, dict):
        return None, None
    signal = exit_code.get("signal") or {}
    number = _number(signal.get("id", signal.get("signal_id")))
    return _number(exit_code.get("return_code")), number or None


def _number(value: Any) -> int | None:
    """A number as 22.05 writes it (plain) or 23.11+ (`{"set", "infinite", "number"}`)."""
    if isinstance(value, dict):
        return int(value["number"]) if value.get("set") and not value.get("infinite") else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _word(value: Any) -> str:
    """A state: a word (22.05) or a list of words, the base state first (23.11+)."""
    if isinstance(value, list):
        return str(value[0]) if value else ""
    return str(value or "")


# -- sacct -P ----------------------------------------------------------------------------------

def from_parsable(text: str, jobid: str) -> Ended | None:
    """`sacct -n -P -o PARSABLE_FIELDS -j JOBID`'s lines: the job's, then one per step."""
    rows = [dict(zip(PARSABLE_FIELDS, line.split("|"), strict=False))
            for line in text.splitlines() if line.strip()]
    job = next((r for r in rows if r.get("JobID") == jobid), None)
    if job is None:
        return None
    state, _, by = job.get("State", "").partition(" by ")
    code, signal = _exit_pair(job.get("ExitCode", ""))
    steps = tuple(Step(r["JobID"], r.get("State", "").split(" ")[0], *_exit_pair(r.get("ExitCode", "")))
                  for r in rows if r is not job and r.get("JobID", "").startswith(f"{jobid}."))
    limit = _int(job.get("TimelimitRaw"))
    reason = job.get("Reason", "")
    return Ended(state=state.strip(), reason="" if reason == "None" else reason, exit_code=code,
                 signal=signal, nodes=job.get("NodeList", ""),
                 cancelled_by=f"uid {by.strip()}" if by.strip() else "",
                 elapsed_s=_int(job.get("ElapsedRaw")), limit_s=None if limit is None else limit * 60,
                 steps=steps)


def _exit_pair(text: str) -> tuple[int | None, int | None]:
    """`ExitCode` `N:S`: the return code and the signal (0: none)."""
    code, _, signal = text.partition(":")
    return _int(code), _int(signal) or None


def _int(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() else None
