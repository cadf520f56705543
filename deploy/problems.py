"""One mechanism for every refusal: a check returns `Problem`s, `ddpkit validate` and the
renderers report them the same way.

- `JobSpec` validation (deploy/spec.py) finds what is wrong whatever the target.
- Each target has `check(job) -> list[Problem]`: the Slurm renderer (`deploy.slurm.render.check`)
  and the Kubernetes renderer (`deploy.k8s.render.check(job, flavor)`, which asks the flavor's
  own check). A check never raises; it lists everything the target cannot do with the job.
- `target_problems(job, target)` runs one target's check; `refuse(job, problems)` turns the
  problems into one `UserError`, each line `FILE:LINE: dotted.path: message; fix` through the
  job file's line map (or `--set KEY` when an override set the field).
- Renderers call `require(job, target)` first, so `render`, `submit` and `run --docker` stop with
  exactly the lines `ddpkit validate` prints, before anything is written.

Which targets `ddpkit validate` checks: `--target` when given; else the targets whose section
(`k8s:`, `slurm:`) the job file (or a `--set`) writes; a job with neither section is checked
for every target, and one with both for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from deploy.errors import UserError

if TYPE_CHECKING:
    from deploy.spec import JobSpec

#: Every target a job renders for; `k8s` is one target with several flavors.
TARGETS = ("k8s", "slurm")


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


def target_problems(job: JobSpec, target: str, *, flavor: str | None = None) -> list[Problem]:
    """What `target` (`k8s`, with `flavor` or k8s.flavor, or `slurm`) cannot do with `job`."""
    if target == "slurm":
        from deploy.slurm.render import check

        return check(job)
    if target == "k8s":
        from deploy.k8s.render import check

        return check(job, flavor or job.k8s.flavor)
    raise ValueError(f"unknown target {target!r}")


def refuse(job: JobSpec, problems: list[Problem]) -> None:
    """Raise one UserError with a located line per problem (nothing when there are none)."""
    if problems:
        lines = []
        for problem in problems:
            line = f"{job.where(problem.path)}: {problem}"
            if line not in lines:
                lines.append(line)
        raise UserError(*lines)


def require(job: JobSpec, target: str, *, flavor: str | None = None) -> None:
    """Stop (UserError) when `target` cannot run `job`: what renderers call first."""
    refuse(job, target_problems(job, target, flavor=flavor))


def targets_of(job: JobSpec) -> list[str]:
    """The targets a job is meant for: the sections it writes, else all of them."""
    written = [t for t in TARGETS if t in job.model_fields_set]
    return written or list(TARGETS)
