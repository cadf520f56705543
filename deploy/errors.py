"""The two kinds of failure a user sees, and how the CLI reports them.

`UserError` is bad input (exit 2): one line per problem, naming the field and the fix.
`RuntimeFailure` is something that went wrong while doing what was asked (exit 1).
Neither prints a traceback.
"""

from __future__ import annotations


class FieldProblem(str):
    """One problem of a job file as the line the CLI prints, `WHERE: FIELD: MESSAGE`, that
    also keeps its parts: `.where` (`job.yaml:12`, `--set nodes`), `.field` (`slurm.partition`),
    `.message` (what is wrong; the fix)."""

    where: str
    field: str
    message: str

    def __new__(cls, where: str, field: str, message: str) -> FieldProblem:
        line = super().__new__(cls, f"{where}: {field}: {message}")
        line.where, line.field, line.message = where, field, message
        return line


class UserError(Exception):
    """Bad input. `problems` holds one line per problem (at least one); a job's problems are
    `FieldProblem`s."""

    exit_code = 2

    def __init__(self, *problems: str):
        self.problems = [p for p in problems if p] or ["invalid input"]
        super().__init__("\n".join(self.problems))


class RuntimeFailure(Exception):
    """The request was valid but could not be carried out (a cluster refused it, ...)."""

    exit_code = 1
