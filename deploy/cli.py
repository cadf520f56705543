"""The `ddpkit` command line.

Exit codes: 0 success, 2 bad input (one line per problem on stderr, no traceback, nothing
half-written), 1 runtime failure, 130 interrupted. Heavy libraries (torch, kubernetes,
submitit) are imported only inside the command that needs them: `validate` and `render` stay
fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from deploy import __version__
from deploy.api import Handle, Job
from deploy.errors import RuntimeFailure, UserError
from deploy.kube import FLAVOR_KIND
from deploy.targets import REGISTRY, TARGETS, load_module

STARTER = Path(__file__).with_name("starter.yaml")


# ---------------------------------------------------------------------------------------------
# helpers


def _load(args: argparse.Namespace) -> Job:
    return Job.from_file(args.job, args.set or [])


def write_output(text: str, output: str | None) -> None:
    """Print, or write the whole text atomically: a failed render leaves no partial file."""
    if not output or output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(output)
    if target.is_dir():
        raise UserError(f"-o {output}: is a directory; give a file name")
    if not target.parent.exists():
        raise UserError(f"-o {output}: directory {target.parent} does not exist")
    import tempfile  # only when writing a file (render speed)

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# commands


OWN_CODE = """\
# Your own torchrun script, unchanged: on every node the launcher runs `torchrun ... {shown}`
# with the same rendezvous, master wait, restarts and signals as the built-in trainer.
# It must exist on every node: {where}.
{key}: {value}
args: []             # its arguments, e.g. [--epochs, 3]

"""
WHERE = {
    "script": "a path relative to the working directory (the image's /workspace on\n# "
              "Kubernetes and Docker, the submit directory on Slurm, the current directory for "
              "--local),\n# or an absolute path on a volume",
    "module": "importable there (installed in the image, or on PYTHONPATH)",
}


def starter_text(script: str | None = None, module: str | None = None) -> str:
    """The starter job file; with a script or module, its `train:`/`checkpoint:` sections (the
    built-in trainer's) are replaced by `script:`/`module:` and `args:`."""
    text = STARTER.read_text(encoding="utf-8")
    if script is None and module is None:
        return text
    key, value = ("script", script) if script is not None else ("module", module)
    blocks = [b for b in text.split("\n\n") if not b.lstrip().startswith(("checkpoint:", "train:"))]
    own = OWN_CODE.format(key=key, value=json.dumps(value), where=WHERE[key],
                          shown=value if key == "script" else f"-m {value}")
    blocks.insert(len(blocks) - 2, own.rstrip("\n"))  # before the k8s: and slurm: sections
    return "\n\n".join(blocks)


def cmd_init(args: argparse.Namespace) -> int:
    target = Path(args.path)
    if target.exists() and not args.force:
        raise UserError(f"{target}: already exists; pass --force to overwrite it")
    if args.script is not None and args.module is not None:
        raise UserError("init: give --script or --module, not both")
    write_output(starter_text(args.script, args.module), str(target))
    print(f"wrote {target}: edit it, then `ddpkit validate {target}` and `ddpkit run {target} --local`",
          file=sys.stderr)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    loaded = _load(args)
    targets, job = loaded.validate(args.target, flavor=args.flavor), loaded.spec
    checked = ", ".join(f"k8s ({args.flavor or job.k8s.flavor})" if t == "k8s" else t for t in targets)
    nodes = f"{job.nodes} nodes" if job.nodes.elastic else f"{job.nodes.min} node(s)"
    device = f"{job.gpus_per_node} GPU(s)" if job.gpus_per_node else "CPU"
    program = f", runs {job.script}" if job.script else f", runs -m {job.module}" if job.module else ""
    if job.workdir is not None:  # checked already: the tree is fine
        snapshot = load_module("deploy.workdir", "workdir").snapshot(job)
        program += f" from workdir {snapshot.root} ({snapshot.describe()})"
    print(f"{args.job}: ok: {job.name}, {nodes} x {job.nproc_per_node} process(es) on {device}, "
          f"world size {job.world_size}, backend {job.backend}{program}; checked for {checked}")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    job = _load(args)
    write_output(job.render(args.target, flavor=args.flavor), args.output)
    REGISTRY[args.target].after_render(job.spec)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    job = _load(args)
    if args.docker:
        return job.run_docker(flavor=args.flavor)
    if args.flavor:
        raise UserError("--flavor applies to `run --docker` only")
    return job.run_local(nproc=args.nproc)


def cmd_submit(args: argparse.Namespace) -> int:
    print(_load(args).submit(args.target, flavor=args.flavor, via=args.via, dry_run=args.dry_run))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    handles = [Handle(text) for text in args.handle]
    if args.watch is not None:
        return load_module("deploy.watch", "`ddpkit status --watch`").watch(handles, every_s=args.watch)
    for handle in handles:
        report = handle.report()
        print(json.dumps(report.as_json(handle.text)) if args.json else
              (f"{handle}  " if len(handles) > 1 else "") + report.text())
    return 0


def cmd_why(args: argparse.Namespace) -> int:
    print("\n".join(Handle(args.handle).why()))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    Handle(args.handle).logs(args.rank, worker_rank=args.worker_rank, every=args.all, grep=args.grep,
                             attempt=args.attempt, previous=args.previous, follow=args.follow, out=sys.stdout)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    Handle(args.handle).cancel(wait_s=args.wait)
    print(f"cancelled {args.handle}")
    return 0


def cmd_lint(args: argparse.Namespace) -> int:
    return load_module("deploy.lint.command", "`ddpkit lint`").run_lint(args.files, crds_dir=args.crds,
                                                           k8s_version=args.k8s_version,
                                                           strict=args.strict)


def cmd_plot(args: argparse.Namespace) -> int:
    plot = load_module("trainer.plot", "`ddpkit plot`")
    try:
        path = plot.plot_runs(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    print(path)
    return 0


def cmd_image(args: argparse.Namespace) -> int:
    return load_module("deploy.image", "`ddpkit image`").main(args)


def cmd_testbed(args: argparse.Namespace) -> int:
    if args.nodes is not None:
        if args.kind != "k8s" or args.action != "up":
            raise UserError("--nodes: only `testbed k8s up` takes a node count (the Slurm testbed has 2 nodes)")
        if not 1 <= args.nodes <= 16:
            raise UserError(f"--nodes {args.nodes}: give 1 to 16 kubelets")
        os.environ["DDPKIT_K8S_TESTBED_NODES"] = str(args.nodes)
    if args.kueue:
        if args.kind != "k8s" or args.action != "up":
            raise UserError("--kueue: only `testbed k8s up` starts Kueue")
        os.environ["DDPKIT_K8S_TESTBED_KUEUE"] = "1"
    return load_module(f"deploy.testbed.{args.kind}", f"the {args.kind} testbed").main(args.action)


# ---------------------------------------------------------------------------------------------
# parser


def _with_job(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOB", help="job file (YAML)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field, YAML-typed (repeatable): --set nodes=4 "
                        "--set train.lr=0.1 --set volumes.0.read_only=true")


def _command(sub, name: str, func, help_: str, example: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {example}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func)
    return p


#: Every command, in the order `ddpkit --help` lists them (a test holds it to the parser's).
COMMANDS = ("init", "validate", "render", "run", "submit", "status", "why", "logs", "cancel",
            "lint", "plot", "image", "testbed")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only` (a command the command line names first), that command's parser
    alone: what argparse does with such a command line needs no other, and making the others
    is a fifth of what `ddpkit render` runs of its own."""
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Run one PyTorch DDP entry point on a laptop, Kubernetes and Slurm.",
        epilog="example:\n  ddpkit init job.yaml && ddpkit run job.yaml --local",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if only is not None:
        sub = _Only(sub, only)

    _job_commands(sub)
    _handle_commands(sub)
    _tool_commands(sub)
    return parser


class _Only:
    """The subparsers of `build_parser(only=NAME)`: NAME's parser is made, the others not."""

    def __init__(self, sub, name: str):
        self.sub, self.name = sub, name

    def add_parser(self, name: str, **kwargs):
        return self.sub.add_parser(name, **kwargs) if name == self.name else _NotMade()


class _NotMade:
    """A command's parser that `build_parser(only=...)` does not make: its arguments go nowhere."""

    def add_argument(self, *args, **kwargs) -> None:
        return None

    def add_mutually_exclusive_group(self, **kwargs) -> _NotMade:
        return self

    def set_defaults(self, **kwargs) -> None:
        return None


def _job_commands(sub) -> None:
    """The commands that read a job file: init, validate, render, run, submit."""
    p = _command(sub, "init", cmd_init, "write a commented starter job file",
                 "ddpkit init job.yaml --script train.py")
    p.add_argument("path", nargs="?", default="job.yaml", metavar="PATH")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--script", metavar="FILE",
                   help="run your own torchrun script (unchanged) instead of the built-in trainer")
    p.add_argument("--module", metavar="MODULE", help="the same for a module (`python -m MODULE`)")

    p = _command(sub, "validate", cmd_validate, "check a job file; print every problem at once",
                 "ddpkit validate examples/multinode-gpu.yaml --set nodes=4")
    _with_job(p)
    p.add_argument("--target", choices=list(TARGETS),
                   help="check for this target only (default: the targets whose section, k8s: "
                        "or slurm:, the job writes; every target when it writes neither)")
    p.add_argument("--flavor", choices=list(FLAVOR_KIND),
                   help="k8s: check this flavor instead of k8s.flavor (implies --target k8s)")

    p = _command(sub, "render", cmd_render, "print Kubernetes manifests or an sbatch script",
                 "ddpkit render k8s examples/multinode-gpu.yaml | kubectl apply -f -\n"
                 "  ddpkit render slurm examples/multinode-gpu.yaml -o job.sbatch && sbatch job.sbatch")
    p.add_argument("target", choices=list(TARGETS), metavar="TARGET", help="k8s or slurm")
    _with_job(p)
    p.add_argument("--flavor", choices=list(FLAVOR_KIND),
                   help="k8s: override k8s.flavor")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE (atomically)")

    p = _command(sub, "run", cmd_run, "run the job on this machine: local processes or Docker",
                 "ddpkit run examples/quickstart.yaml --local --nproc 2")
    _with_job(p)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="each node of the job as a local launcher of N processes (gloo on CPU)")
    where.add_argument("--docker", action="store_true",
                       help="each rendered Kubernetes pod as a Docker container")
    p.add_argument("--nproc", type=int, metavar="N", help="--local: processes (default: the job's)")
    p.add_argument("--flavor", choices=list(FLAVOR_KIND),
                   help="--docker: which Kubernetes flavor's pods to run")

    p = _command(sub, "submit", cmd_submit, "submit to a cluster; print a job handle",
                 "ddpkit submit slurm examples/quickstart-2node.yaml")
    p.add_argument("target", choices=list(TARGETS), metavar="TARGET", help="k8s or slurm")
    _with_job(p)
    p.add_argument("--dry-run", action="store_true",
                   help="k8s: server-side dry run; slurm: sbatch --test-only")
    p.add_argument("--flavor", choices=list(FLAVOR_KIND),
                   help="k8s: override k8s.flavor")
    p.add_argument("--via", choices=["sbatch", "submitit"], help="slurm: how to submit")


def _handle_commands(sub) -> None:
    """The commands that take a job handle: status, logs, cancel."""
    p = _command(sub, "status", cmd_status, "print a job's state (QUEUED, PENDING, RUNNING, "
                 "RESTARTING, SUCCEEDED, FAILED, CANCELLED) first, then its progress: step, epoch, samples/s, "
                 "ETA, goodput, restarts", "ddpkit status slurm://1234\n  ddpkit status runs/quickstart --json\n"
                 "  ddpkit status --watch k8s://ml/pytorchjob/cifar-ddp slurm://1234")
    p.add_argument("handle", metavar="HANDLE", nargs="+",
                   help="a job handle (printed by `ddpkit submit`) or a local run's directory")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="one JSON object per job")
    shown.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                       help="a live view, refreshed every SECONDS (default 2) until every job has ended")

    p = _command(sub, "why", cmd_why, "why a job failed (or where it is): the cause in one line "
                 "(CATEGORY: rank, node, attempt: evidence), then each attempt",
                 "ddpkit why slurm://1234\n  ddpkit why runs/quickstart")
    p.add_argument("handle", metavar="HANDLE", help="a job handle or a local run's directory")

    p = _command(sub, "logs", cmd_logs, "print a job's logs: one node's (default node 0), one "
                 "process's, or every node's", "ddpkit logs k8s://ml/pytorchjob/cifar-ddp --rank 1 -f\n"
                 "  ddpkit logs slurm://1234 --all --grep 'Error|NCCL'\n"
                 "  ddpkit logs runs/quickstart --previous")
    p.add_argument("handle", metavar="HANDLE", help="a job handle (printed by `ddpkit submit`) or a "
                   "local run's directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="N", help="node rank N, the same on every target "
                       "(default 0): Kubernetes: node N's pod; Slurm: node N's lines of the job's file")
    which.add_argument("--worker-rank", type=int, metavar="R", help="global rank R (torch's RANK, one "
                       "process): its lines (where one process runs a node's workers, torchrun's, the "
                       "lines that name it: `ddpkit rank R`, `[rankR]:`)")
    which.add_argument("--all", action="store_true", help="every node's lines, each starting "
                       "[NODE/RANK] (RANK: the process's global rank, - for torchrun's and the launcher's)")
    p.add_argument("--grep", metavar="REGEX", help="only the lines that match (Python regular expression)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--attempt", type=int, metavar="K", help="what the job's start K wrote (from 0; "
                      "Slurm: restart K of a requeued job; a local run: its K-th `ddpkit run --local`)")
    when.add_argument("--previous", action="store_true", help="the attempt before the last: Kubernetes: "
                      "the pod's previous container; Slurm and local runs: the start before the last")
    p.add_argument("-f", "--follow", action="store_true", help="keep following")

    p = _command(sub, "cancel", cmd_cancel, "cancel a job", "ddpkit cancel slurm://1234")
    p.add_argument("handle", metavar="HANDLE")
    p.add_argument("--wait", type=float, metavar="SECONDS", default=None,
                   help="wait until the job has ended and its objects are gone (default: 30 for "
                        "Slurm, 300 for Kubernetes, as `kubectl delete` waits; 0: return at once)")


def _tool_commands(sub) -> None:
    """lint, plot, image, testbed."""
    p = _command(sub, "lint", cmd_lint, "check manifests offline as the API server and the operators' webhooks would",
                 "ddpkit render k8s job.yaml -o job.k8s.yaml && ddpkit lint job.k8s.yaml")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--crds", metavar="DIR",
                   help="directory of CustomResourceDefinitions (YAML) that take precedence over the bundled ones")
    p.add_argument("--strict", action="store_true", help="warnings (ddpkit's advice) fail too (exit 1)")
    p.add_argument("--k8s-version", metavar="X.Y",
                   help="Kubernetes version of the core schemas (default: the newest bundled)")

    p = _command(sub, "plot", cmd_plot, "plot loss and throughput of one or more run directories",
                 "ddpkit plot runs/quickstart runs/quickstart-lr01 -o compare.png")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+", help="run directories (several: overlaid)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="PNG to write (default: RUN_DIR/metrics.png for one run, runs-compared.png for several)")

    p = _command(sub, "image", cmd_image, "build the training image (Docker, BuildKit)",
                 "ddpkit image build --offline --base-image debian-bookworm")
    p.add_argument("action", choices=["build"], metavar="ACTION", help="build")
    p.add_argument("--tag", metavar="TAG", help="image tag (default: ddpkit:<major.minor>)")
    p.add_argument("--offline", action="store_true",
                   help="install only from a wheelhouse prepared on this host (pip --no-index)")
    p.add_argument("--wheelhouse", metavar="DIR",
                   help="--offline: where the wheels are or go (default: wheelhouse/)")
    p.add_argument("--base-image", metavar="IMAGE",
                   help="base image (default: the Dockerfile's, the official PyTorch runtime)")

    p = _command(sub, "testbed", cmd_testbed, "a real local cluster to try jobs on (root)",
                 "sudo ddpkit testbed slurm up")
    p.add_argument("kind", choices=["slurm", "docker", "k8s"], metavar="KIND",
                   help="slurm (2-node cluster), docker (dockerd + a debootstrap base image) or "
                        "k8s (an N-node Kubernetes with the Kubeflow and JobSet controllers)")
    p.add_argument("action", choices=["up", "down", "status", "env"], metavar="ACTION",
                   help="up, down, status, or env (prints the lines that point clients at it: "
                        "PATH, and KUBECONFIG for k8s)")
    p.add_argument("--nodes", type=int, metavar="N",
                   help="k8s up: how many kubelets, each in its own network namespace (default 2; "
                        "a cluster up with another count is rebuilt)")
    p.add_argument("--kueue", action="store_true",
                   help="k8s up: also start Kueue, with a LocalQueue `ddpkit` in namespace default "
                        "sized to the nodes (k8s.queue: ddpkit); on a cluster that is up, adds it")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return exc.exit_code
    except RuntimeFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `ddpkit render ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
