"""What a Kubernetes rule finds, before `ddpkit lint` places it in a file (deploy/lint/report.py):
a field path and a message, field paths joined as the API server writes them, and input that no
rule can judge."""

from __future__ import annotations

#: A finding before it is placed in a file: (path, message).
Finding = tuple[str, str]


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
