"""What every layer of `ddpkit lint` reports: a Problem (where, what, how bad) and bad input."""

from __future__ import annotations

from dataclasses import dataclass

#: A real API server (or an operator's admission webhook) would refuse the object.
ERROR = "error"
#: Accepted by the server, but ddpkit's advice says it will hurt (or the controller's later
#: objects, e.g. the pods of a JobSet, will be refused). Exit 0 unless `--strict`.
WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    """One finding: where (file, object, field path), what, and whether a server refuses it."""

    source: str
    obj: str
    path: str
    message: str
    rule: str = "schema"
    severity: str = ERROR

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.source}: {self.obj}: {self.severity}: {where}{self.message} [{self.rule}]"


class LintInputError(Exception):
    """The input itself is unusable (unreadable file, bad YAML, a CRD directory that is not)."""


def join(path: str, key: str | int) -> str:
    """`spec.a` + `b` = `spec.a.b`; `spec.a` + 0 = `spec.a[0]` (the API server's field paths)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


#: A finding before it is placed in a file: (path, message).
Finding = tuple[str, str]


class LintBug(Exception):
    """One of ddpkit's own rules crashed on an object the schema layer had accepted: a bug in
    ddpkit, never the user's bad input (the traceback is kept; please report it)."""
