"""One mechanism for every refusal: a check returns `Problem`s, `ddpkit validate` and the
renderers report them the same way. A leaf: it imports no renderer and dispatches nothing.

- `JobSpec` validation (deploy/spec.py) finds what is wrong whatever the target.
- Each target's renderer has `check(job, flavor) -> list[Problem]` (deploy/targets.py is the
  registry): `deploy.slurm.render.check` and `deploy.k8s.render.check`, which asks the flavor's
  own check. A check never raises; it lists everything the target cannot do with the job.
- `refuse(job, problems)` turns the problems into one `UserError`, each line
  `FILE:LINE: dotted.path: message; fix` through the job file's line map (or `--set KEY` when
  an override set the field): `job` is anything `Located` (a `JobSpec`), so this module needs
  nothing of the job model.
- Renderers refuse their own check's problems first, so `render`, `submit` and `run --docker`
  stop with exactly the lines `ddpkit validate` prints, before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deploy.errors import FieldProblem, UserError


class Located(Protocol):
    """What `refuse` asks of a job: where a dotted field path was written (`JobSpec.where`:
    `FILE:LINE`, or `--set KEY`)."""

    def where(self, path: str) -> str: ...


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a job: the field, what is wrong, and what to write instead."""

    path: str
    message: str
    fix: str = ""

    @property
    def text(self) -> str:
        """What is wrong, then the fix."""
        return self.message + (f"; {self.fix}" if self.fix else "")

    def __str__(self) -> str:
        return f"{self.path}: {self.text}"


class Problems(ValueError):
    """Raised inside a pydantic validator to report problems at field paths relative to the
    model being validated (instead of pydantic's one error at the model itself)."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def refuse(job: Located, problems: list[Problem]) -> None:
    """Raise one UserError with a located line per problem (nothing when there are none)."""
    if problems:
        lines = []
        for problem in problems:
            line = FieldProblem(job.where(problem.path), problem.path, problem.text)
            if line not in lines:
                lines.append(line)
        raise UserError(*lines)
