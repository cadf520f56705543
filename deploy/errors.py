"""The two kinds of failure a user sees, and how the CLI reports them.

`UserError` is bad input (exit 2): one line per problem, naming the field and the fix.
`RuntimeFailure` is something that went wrong while doing what was asked (exit 1).
Neither prints a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input. `problems` holds one line per problem (at least one)."""

    exit_code = 2

    def __init__(self, *problems: str):
        self.problems = [p for p in problems if p] or ["invalid input"]
        super().__init__("\n".join(self.problems))


class RuntimeFailure(Exception):
    """The request was valid but could not be carried out (a cluster refused it, ...)."""

    exit_code = 1
