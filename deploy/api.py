"""ddpkit's Python API, `import ddpkit`: what the CLI does, for notebooks and sweeps.

    import ddpkit

    job = ddpkit.Job.from_file("examples/quickstart.yaml", {"train.epochs": 1})
    job.validate("slurm")                       # InvalidJob: every problem, with its field
    print(job.render("k8s", flavor="jobset"))   # the text `kubectl apply -f -` takes
    handle = job.submit("slurm")                # a Handle: slurm://JOBID
    handle.wait(timeout=3600)                   # SUCCEEDED, FAILED or CANCELLED

A `Job` is validated when it is made (`Job(**fields)` mirrors the job file's keys), so a
`Job` is always a valid job file; `validate(target)` adds what one target cannot do. The CLI
is a thin layer over these calls: the same checks, the same messages. Errors are
`InvalidJob` (bad input: `.problems`, each with `.where`, `.field`, `.message`) and
`RuntimeFailure` (a cluster or tool refused). Heavy libraries load only in the call that needs
them (kubernetes for a Kubernetes handle, torch only in the trainer's processes).
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.errors import RuntimeFailure, UserError
from deploy.kube import FLAVORS, STATES, TERMINAL_STATES
from deploy.problems import refuse
from deploy.targets import REGISTRY, TARGETS, load_module, of_handle, refuse_option, targets_of

if TYPE_CHECKING:
    from deploy.load import Overrides
    from deploy.progress import Report
    from deploy.spec import JobSpec

__all__ = ["FLAVORS", "STATES", "TARGETS", "Handle", "InvalidJob", "Job", "RuntimeFailure"]

#: Bad input: a `UserError` (the CLI's exit 2) whose `.problems` are `FieldProblem` lines.
InvalidJob = UserError

class Job:
    """One validated job. `Job(name=..., image=..., nodes=2, train={"epochs": 1})` takes the
    job file's keys; `Job.from_file(path, overrides)` reads one. `InvalidJob` lists every
    problem at once."""

    def __init__(self, **fields: Any):
        from deploy.load import parse_job  # the job model (pydantic): not for a handle's verbs

        self._spec = parse_job(fields, source="Job(...)")
        self.source = "Job(...)"

    @classmethod
    def from_file(cls, path: str | Path, overrides: Overrides = ()) -> Job:
        """The job file at `path`, with `overrides` applied as `--set` would: a mapping of dotted
        keys to values (`{"nodes": 4, "train.lr": 0.1}`) or `["nodes=4"]` (values as YAML)."""
        from deploy.load import load_job

        return cls._of(load_job(str(path), overrides), str(path))

    @classmethod
    def _of(cls, spec: JobSpec, source: str) -> Job:
        job = cls.__new__(cls)
        job._spec, job.source = spec, source
        return job

    @property
    def spec(self) -> JobSpec:
        """The typed model (deploy.spec.JobSpec): `job.spec.nodes`, `job.spec.world_size`."""
        return self._spec

    @property
    def name(self) -> str:
        return self._spec.name

    def to_yaml(self) -> str:
        """The job file with defaults filled in: what every node reads."""
        return self._spec.to_yaml()

    def validate(self, target: str | None = None, *, flavor: str | None = None) -> list[str]:
        """What `target` (default: the targets whose section the job writes, else all; `flavor`
        alone means k8s) cannot do with the job: `InvalidJob` with every problem. The targets
        checked, when there are none."""
        if flavor and target == "slurm":
            raise UserError("--flavor applies to --target k8s only")
        targets = [target] if target else (["k8s"] if flavor else targets_of(self._spec))
        for name in targets:
            _target(name)
        refuse(self._spec, [p for t in targets for p in REGISTRY[t].check(self._spec, flavor if t == "k8s" else None)])
        return targets

    def request(self, target: str, *, flavor: str | None = None) -> object:
        """What would be sent, as data: the Kubernetes objects (dicts) or the `SbatchRequest`."""
        refuse_option(target, "render", flavor=flavor)
        return _target(target).request(self._spec, flavor=flavor)

    def render(self, target: str, *, flavor: str | None = None) -> str:
        """The manifests (`kubectl apply -f -`) or the sbatch script, as `ddpkit render`."""
        refuse_option(target, "render", flavor=flavor)
        return _target(target).render(self._spec, flavor=flavor, source=self.source)

    def submit(self, target: str, *, flavor: str | None = None, via: str | None = None,
               dry_run: bool = False) -> Handle:
        """Submit to `target` (Kubernetes: the current kubeconfig context; Slurm: sbatch or
        submitit on this machine); the job's `Handle`."""
        refuse_option(target, "submit", via=via, flavor=flavor)
        return Handle(_target(target).submit(self._spec, dry_run=dry_run, source=self.source,
                                             flavor=flavor, via=via))

    def run_local(self, nproc: int | None = None) -> int:
        """Train as the job's nodes' local launchers, `nproc` processes each (gloo on CPU), as
        `ddpkit run --local`: the exit code (0 done, 143 stopped after a checkpoint, 137 stopped
        before one)."""
        return load_module("deploy.run.local", "`ddpkit run --local`").run_local(self._spec, self.source, nproc=nproc)

    def run_docker(self, *, flavor: str | None = None) -> int:
        """Run the Kubernetes pods of `flavor` as Docker containers, as `ddpkit run --docker`."""
        return load_module("deploy.run.docker", "`ddpkit run --docker`").run_docker(self._spec, self.source, flavor=flavor)

    def __repr__(self) -> str:
        return f"Job({self.name!r}, nodes={self._spec.nodes}, nproc_per_node={self._spec.nproc_per_node})"


def _target(name: str):
    if name not in REGISTRY:
        raise UserError(f"target {name!r}: use one of {', '.join(TARGETS)}")
    return REGISTRY[name]


class Handle:
    """A submitted job: `k8s://NAMESPACE/FLAVOR/NAME` or `slurm://JOBID`, as `ddpkit submit`
    prints it (`Handle("slurm://1234")` picks one up again); or a local run's directory
    (`Handle("runs/quickstart")`), for `status`, `report` and `wait`."""

    def __init__(self, text: str):
        self._target = of_handle(str(text))
        self.text = str(text)
        self._said: set[str] = set()  # what `wait` has shown of `tend`

    def status(self) -> str:
        """The state, one of `STATES`."""
        return self.describe().split()[0]

    def describe(self) -> str:
        """The state first, then why where the target says (`FAILED (NODE_FAIL: ...)`)."""
        return self._target.describe(self.text)

    def report(self) -> Report:
        """What `ddpkit status` prints: `.state`, `.state_line`, the trainer's newest progress
        record (`.record`: step, ETA, goodput, restarts; None before the first one or for a
        `script:` job), `.waited_s`; `.text()` is the line, `.as_json(handle)` the JSON."""
        return self._target.report(self.text)

    def wait(self, timeout: float | None = None, *, poll_s: float = 5.0) -> str:
        """Block until the job has ended; its final state. TimeoutError after `timeout` s.
        Watches as `ddpkit status --watch` does (`tend`), its lines to stderr."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.status()) not in TERMINAL_STATES:
            self._say(self.tend(ended=False))
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.text} still {state} after {timeout:g}s")
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
        self._say(self.tend(ended=True))
        return state

    def tend(self, *, ended: bool) -> list[str]:
        """What a watcher does beside reading, once a refresh: on Kubernetes, while the job
        runs, label the nodes lost under it so that its pods stay off them (`k8s.avoid_lost_nodes`,
        deploy/k8s/blame.py), and once it has `ended` take the labels off. The lines to show."""
        return self._target.tend(self.text, ended)

    def _say(self, lines: list[str]) -> None:
        for line in lines:
            if line not in self._said:
                self._said.add(line)
                print(line, file=sys.stderr, flush=True)

    def logs(self, rank: int | None = None, *, worker_rank: int | None = None, every: bool = False,
             grep: str | None = None, attempt: int | None = None, previous: bool = False,
             follow: bool = False, out: Any = None) -> str | None:
        """The log of node `rank` (default 0; a node rank on every target), of global rank
        `worker_rank` (one process), or `every` node's lines each starting `[NODE/RANK] `; with
        `grep`, only the lines that match that regular expression; `attempt` K or `previous`,
        an earlier start's lines (Kubernetes: `previous`, the pod's previous container). As
        text; with `out` (a file-like object), written there as it comes instead (with
        `follow`, until the job ends). As `ddpkit logs` (deploy/logs.py)."""
        from deploy.logs import Query

        query = Query(rank=rank, worker_rank=worker_rank, every=every, grep=grep, attempt=attempt,
                      previous=previous)
        if out is not None:
            self._target.logs(self.text, query=query, follow=follow, out=out)
            return None
        buffer = io.StringIO()
        self._target.logs(self.text, query=query, follow=follow, out=buffer)
        return buffer.getvalue()

    def why(self) -> list[str]:
        """Why the job ended as it did (or where it is): the first line is
        `CATEGORY: rank R on NODE, attempt N: EVIDENCE` (deploy/why.py's CATEGORIES), then
        details per attempt and the scheduler's words."""
        return self._target.why(self.text)

    def cancel(self, *, wait_s: float | None = None) -> None:
        """Cancel the job and wait until it is gone (the target's default wait; 0: at once)."""
        self._target.cancel(self.text, wait_s=wait_s)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Handle({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)
