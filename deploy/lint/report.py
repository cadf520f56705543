"""What `ddpkit lint` reports: a `LintFinding` (where in which file, what, how bad), and
`LintBug` for a crash of ddpkit's own rules. The rules' raw findings are deploy/kube/finding.py's."""

from __future__ import annotations

from dataclasses import dataclass

#: A real API server (or an operator's admission webhook) would refuse the object.
ERROR = "error"
#: Accepted by the server, but ddpkit's advice says it will hurt (or the controller's later
#: objects, e.g. the pods of a JobSet, will be refused). Exit 0 unless `--strict`.
WARNING = "warning"


@dataclass(frozen=True)
class LintFinding:
    """One finding placed: where (file, object, field path), what, and whether a server refuses it."""

    source: str
    obj: str
    path: str
    message: str
    rule: str = "schema"
    severity: str = ERROR

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.source}: {self.obj}: {self.severity}: {where}{self.message} [{self.rule}]"


class LintBug(Exception):
    """One of ddpkit's own rules crashed on an object the schema layer had accepted: a bug in
    ddpkit, never the user's bad input (the traceback is kept; please report it)."""
