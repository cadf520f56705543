"""The targets a job renders for and is submitted to, as one registry the CLI dispatches through.

A target is two modules, imported on first use (`render` stays fast, `status` never loads
jinja2): its renderer (`check(job, flavor)`, `render(job, flavor=, source=)`) and its
submitter (`submit`, `describe`, `logs`, `cancel`). `k8s` is one target with several flavors
(`deploy/k8s/<flavor>/`); `slurm` takes `--via` instead. The verbs are the same on every
target, so the CLI asks `REGISTRY[name]` and never tests which target it has.

A target whose requests are Kubernetes objects (`linted`) is also judged by `ddpkit lint`'s
rules (deploy/lint/command.py `refusals`): whatever the API server, an operator's webhook or
a controller would refuse of the rendered objects is a `Problem` of `check`, and `request`,
`render` and `submit` refuse it before anything is written or sent (its renderer also lays out
a request it was given, `render_request`, so `render` makes the objects once). The line names the job
field the object's field comes from (the renderer's `job_field`), else the rendered field.

Which targets `ddpkit validate` checks: `--target` when given; else the targets whose section
(`k8s:`, `slurm:`) the job file (or a `--set`) writes; a job with neither section is checked
for every target, and one with both for both.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING

from deploy.errors import RuntimeFailure, UserError
from deploy.problems import Problem, refuse

if TYPE_CHECKING:  # not imported at run time by `render` and `validate`, which need neither
    from deploy.logs import Query
    from deploy.progress import Report, RunDir
    from deploy.spec import JobSpec

#: Which extra of the distribution brings a third-party package a command needs.
EXTRAS = {"kubernetes": "k8s", "submitit": "slurm", "hostlist": "slurm", "torch": "train",
          "matplotlib": "train"}


def load_module(name: str, what: str) -> ModuleType:
    """Import a part of ddpkit lazily; a missing optional dependency is one clear line."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == name or name.startswith(exc.name + ".")):
            raise RuntimeFailure(f"{what} is not available in this ddpkit build") from None
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        hint = f"pip install 'ddpkit[{extra}]'" if extra else f"pip install {exc.name}"
        raise RuntimeFailure(f"{what} needs the Python package {exc.name!r}: {hint}") from None


@dataclass(frozen=True)
class Target:
    """One target: its name (the handle's scheme, the job file's section), its modules, and
    the option only it takes (`--flavor` for k8s, `--via` for slurm)."""

    name: str
    title: str  # "Kubernetes", "Slurm": in "rendering for ..." and "submitting to ..."
    renderer: str
    submitter: str
    option: str
    linted: bool = False  # the request is Kubernetes objects: `ddpkit lint`'s errors refuse it
    tender: str | None = None  # the module whose `tend(handle, ended)` a watcher calls each refresh

    def _renderer(self) -> ModuleType:
        return load_module(self.renderer, f"rendering for {self.title}")

    def _submitter(self) -> ModuleType:
        return load_module(self.submitter, f"submitting to {self.title}")

    def _jobs(self) -> ModuleType:
        return load_module(self.submitter, f"{self.name} jobs")

    def check(self, job: JobSpec, flavor: str | None = None) -> list[Problem]:
        """Everything this target cannot do with `job`: the renderer's checks, then (when they
        pass and the target is `linted`) what lint refuses of the request. Never raises but
        `LintBug`, a crash of ddpkit's own rules."""
        problems = self._renderer().check(job, flavor)
        if problems or not self.linted:
            return problems
        return self._refusals(job, self._renderer().request(job, flavor=flavor))

    def request(self, job: JobSpec, *, flavor: str | None = None) -> object:
        """What `render` lays out, as data (TorchX's dry-run request): the Kubernetes objects
        (a list of dicts), or the Slurm `SbatchRequest`. UserError when `check` finds problems."""
        request = self._renderer().request(job, flavor=flavor)
        if self.linted:
            refuse(job, self._refusals(job, request))
        return request

    def render(self, job: JobSpec, *, flavor: str | None = None, source: str) -> str:
        """The request as the text a user applies: multi-document YAML, or the sbatch script.
        A `linted` request is made once: laid out (`render_request`) before lint reads it, and
        refused as `request` refuses it before any text is out."""
        if not self.linted:
            return self._renderer().render(job, flavor=flavor, source=source)
        request = self._renderer().request(job, flavor=flavor)
        text = self._renderer().render_request(job, request, flavor=flavor, source=source)
        refuse(job, self._refusals(job, request))
        return text

    def _refusals(self, job: JobSpec, objects: list[dict]) -> list[Problem]:
        """Lint's refusals of the rendered objects, each at the job field it comes from."""
        lint = _lint()
        if lint is None:
            return []
        try:
            found = lint.refusals(objects)
        except lint.LintInputError as exc:  # kubernetes-validate missing: a base install
            _not_linted(str(exc))
            return []
        field_of = self._renderer().job_field
        return [_located(job, finding, field_of) for finding in found]

    def after_render(self, job: JobSpec) -> None:
        """What `ddpkit render` does once the text is out (Slurm: make the log directory)."""
        self._renderer().after_render(job)

    def submit(self, job: JobSpec, *, dry_run: bool, source: str, flavor: str | None = None,
               via: str | None = None) -> str:
        """Submit `job`; the handle (`k8s://NS/FLAVOR/NAME`, `slurm://JOBID`)."""
        options = {"flavor": flavor} if self.option == "flavor" else {"via": via or "sbatch"}
        if self.linted:
            self.request(job, flavor=flavor)
        return self._submitter().submit(job, dry_run=dry_run, source=source, **options)

    def describe(self, handle: str) -> str:
        """The state first (scripts parse the first word), then why, where the target says."""
        return self._jobs().describe(handle)

    def report(self, handle: str) -> Report:
        """`ddpkit status`: the state line, the trainer's progress record, the wait to start."""
        return self._jobs().report(handle)

    def why(self, handle: str) -> list[str]:
        """`ddpkit why`: the cause in one line (deploy/why.py), then the details."""
        return self._jobs().why(handle)

    def logs(self, handle: str, *, query: Query, follow: bool, out=None) -> int:
        """Print the lines `query` asks for to `out` (default stdout): `rank` is a node rank
        on every target (default 0), `worker_rank` a global rank (deploy/logs.py)."""
        return self._jobs().logs(handle, query=query, follow=follow, out=out) or 0

    def tend(self, handle: str, ended: bool) -> list[str]:
        """What a watcher does beside reading, once a refresh (Kubernetes: keep the job's pods
        off the nodes lost under it, deploy/k8s/blame.py); the lines to show."""
        if self.tender is None:
            return []
        return load_module(self.tender, f"{self.name} jobs").tend(handle, ended)

    def cancel(self, handle: str, *, wait_s: float | None) -> None:
        jobs = self._jobs()
        jobs.cancel(handle) if wait_s is None else jobs.cancel(handle, wait_s=wait_s)


def _located(job: JobSpec, finding, field_of) -> Problem:
    """A lint finding as the job's Problem: at the job field behind it, else at the rendered
    object's field (`PyTorchJob/demo spec....volumes[2]`); the rule it broke in brackets."""
    field = field_of(job, finding.path)
    if field:
        return Problem(field, f"{finding.message} [{finding.rule}]")
    return Problem(f"{finding.obj} {finding.path}".strip(), f"{finding.message} [{finding.rule}]")


@cache
def _lint() -> ModuleType | None:
    """`ddpkit lint`'s command, or None (after one note) in a build without its packages."""
    try:
        return load_module("deploy.lint.command", "`ddpkit lint`")
    except RuntimeFailure as exc:
        _not_linted(str(exc))
        return None


@cache
def _not_linted(why: str) -> None:
    print(f"note: the Kubernetes objects were not checked as the API server would: {why}",
          file=sys.stderr)


REGISTRY: dict[str, Target] = {
    "k8s": Target("k8s", "Kubernetes", "deploy.k8s.render", "deploy.k8s.submit", option="flavor",
                  linted=True, tender="deploy.k8s.blame"),
    "slurm": Target("slurm", "Slurm", "deploy.slurm.render", "deploy.slurm.submit", option="via"),
}
#: Every target a job renders for; `k8s` is one target with several flavors.
TARGETS = tuple(REGISTRY)


def refuse_option(target: str, verb: str, **given: object) -> None:
    """`--flavor` for a target other than k8s, or `--via` for one other than slurm: one line
    naming the command the option belongs to (`--via applies to `submit slurm` only`)."""
    for option, value in given.items():
        owner = next(t for t in REGISTRY.values() if t.option == option)
        if value and owner.name != target:
            raise UserError(f"--{option} applies to `{verb} {owner.name}` only")


def of_handle(handle: str) -> Target | RunDir:
    """The target a job handle names (`k8s://...`, `slurm://...`); a local run's directory
    (`runs/quickstart`) stands for its run, for `status`."""
    from deploy.progress import RunDir, is_run_dir

    if is_run_dir(handle):
        return RunDir(handle)
    scheme, sep, _ = handle.partition("://")
    if not sep or scheme not in REGISTRY:
        raise UserError(f"{handle!r} is not a job handle: expected k8s://NAMESPACE/FLAVOR/NAME "
                        "or slurm://JOBID (printed by `ddpkit submit`), or a local run's directory")
    return REGISTRY[scheme]


def targets_of(job: JobSpec) -> list[str]:
    """The targets a job is meant for: the sections it writes, else all of them."""
    written = [t for t in TARGETS if t in job.model_fields_set]
    return written or list(TARGETS)
