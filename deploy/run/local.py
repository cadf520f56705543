"""`ddpkit run JOB --local`: the job's nodes as local processes on this machine.

It starts exactly what every cluster target starts, `python -m trainer.launch`, once per node of
the job (`nodes: 2`: two node launchers, as two pods or two Slurm tasks would be, each with its
node rank as an Indexed Job's pod gets it, `JOB_COMPLETION_INDEX`), with the `DDPKIT_*` launch
environment (docs/CONTRACT.md) and one free localhost port for the rendezvous: ranks and world
size are the cluster's (an elastic `MIN:MAX` job runs MAX nodes). Where the machine has a CPU
per node or more, each node launcher gets its own share of the CPUs, as separate machines
would. Output is streamed as it comes, Ctrl-C / SIGTERM forwarded to every node (the trainer
checkpoints and exits 143), then the run's summary printed from `metrics.jsonl`. No torch is
imported here.

With `workdir:` the launcher runs in a copy of the tree (deploy/workdir.py), the one a cluster
would get: `<train.output_dir>/<name>-workdir-<hash>`, beside the run directory, made at start
(kept for the next run of the same tree). The run directory stays where it is without one
(a relative `train.output_dir` is made absolute in the job file the trainer reads), so
`ddpkit status`, `logs` and `why` find it as always; what a script writes to relative paths
lands in the copy, as on a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy import workdir
from deploy.errors import UserError
from trainer.contract import (
    EXIT_STOPPED,
    EXIT_STOPPED_UNSAVED,
    LAUNCH_ARGV,
    LAUNCH_T0_VAR,
    LINE_TAGS_VAR,
    PROGRESS_LINES_VAR,
    WORKDIR_COMMIT_VAR,
    WORKDIR_DIRTY_VAR,
    WORKDIR_HASH_VAR,
    LaunchEnv,
    line_worker_rank,
    node_line_tag,
    read_node_line_tag,
)
from trainer.launch.plan import WORKER_VARS
from trainer.stragglers import describe as describe_straggler

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
WORKDIR_VARS = (WORKDIR_HASH_VAR, WORKDIR_COMMIT_VAR, WORKDIR_DIRTY_VAR)


def free_port() -> int:
    """A port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dir_of(job) -> Path:
    """Where the trainer writes metrics (relative to the current directory)."""
    return Path(job.train.output_dir) / job.name


def write_effective_job(job, run_dir: Path) -> Path:
    """The job after `--set` overrides, written where the trainer reads it (atomically)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.yaml"
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".job.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(job.to_yaml())
    os.replace(tmp, path)
    return path.resolve()


def launch_env(job, job_file: Path, nproc: int, port: int, nodes: int = 1, node: int = 0) -> dict[str, str]:
    """Node `node` of `nodes`'s environment: the launch contract, and the pod index of an
    Indexed Job where there are several nodes (the launcher's `indexed-job` context)."""
    env = {**os.environ, **{k: str(v) for k, v in job.env.items()}}
    for k in [k for k in env if k.startswith(("PET_", "SLURM_", "TORCHELASTIC_"))] + [
        *WORKER_VARS, "JOB_COMPLETION_INDEX", "SKYPILOT_NODE_RANK", *WORKDIR_VARS,
    ]:
        env.pop(k, None)  # a shell inside a cluster job must not make this look like one
    env.update(LaunchEnv(job_file=str(job_file), run_id=job.name, nnodes=str(nodes), nproc_per_node=nproc,
                         max_restarts=job.restarts, launcher="torchrun", master_addr="127.0.0.1",
                         master_port=port).to_env())
    if nodes > 1:
        env["JOB_COMPLETION_INDEX"] = str(node)
    env[LAUNCH_T0_VAR] = repr(time.time())
    return env


def node_cpus(nodes: int) -> list[set[int] | None]:
    """Each node launcher's CPUs: contiguous equal shares of this process's where there is at
    least one CPU per node (separate machines, as on a cluster), else no binding."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return [None] * nodes
    if nodes == 1 or len(cpus) < nodes:
        return [None] * nodes
    share = len(cpus) // nodes
    return [set(cpus[i * share:(i + 1) * share]) for i in range(nodes)]


def metrics_size(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").stat().st_size
    except OSError:
        return 0


def read_summary(run_dir: Path, offset: int = 0) -> dict | None:
    """The summary record written after byte `offset` of metrics.jsonl, if any."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as fh:
            fh.seek(offset)
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        return record if record.get("summary") else None
    return None


def format_summary(s: dict) -> str:
    def num(key: str, fmt: str) -> str:
        return format(s[key], fmt) if s.get(key) is not None else "-"

    rows = [
        ("status", s.get("status", "-")),
        ("steps", f"{s.get('steps')} ({s.get('world_size')} ranks, global batch {s.get('global_batch')})"),
        ("loss", f"{num('first_loss', '.4f')} -> {num('final_loss', '.4f')}"),
        ("eval", ", ".join([f"loss {num('eval_loss', '.4f')}", f"accuracy {num('eval_accuracy', '.3f')}"] + [
            f"{k.removeprefix('eval_')} {num(k, '.4f')}" for k in s
            if k.startswith("eval_") and k not in ("eval_loss", "eval_accuracy")])),
        ("samples/s", num("samples_per_s", ".0f")),
        ("first step", f"{num('first_step_s', '.1f')} s after launch; wall {num('wall_s', '.1f')} s"),
        *([("straggler", describe_straggler(s["straggler"]))] if s.get("straggler") else []),
        ("parameters", "identical on every rank" if s.get("params_identical") else "DIFFER across ranks"),
        ("buffers", {True: "identical on every rank", False: "DIFFER across ranks"}.get(
            s.get("buffers_identical"), "not compared (none, or rank-local BatchNorm statistics)")),
        ("run dir", s.get("run_dir", "-")),
    ]
    return "\n".join(f"  {k:<11} {v}" for k, v in rows)


#: Where `ddpkit run --local` keeps the run's output, each line tagged as `trainer.launch` tags
#: a Slurm node's (`[0/RANK] `), appended run after run: `ddpkit logs RUN_DIR` reads it.
OUTPUT_LOG = "output.log"


def start_line(name: str, nproc: int, nodes: int = 1) -> str:
    """The line each `ddpkit run --local` writes first to RUN_DIR/output.log (deploy/logs.py
    START_LINE: `ddpkit logs RUN_DIR --attempt K` is the K-th run's output)."""
    shape = f"{nodes} nodes x {nproc} processes" if nodes > 1 else f"{nproc} processes"
    return f"ddpkit: {name} (run --local) as {shape}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"


def show_outputs(procs: list[subprocess.Popen], log: Path | None = None, raw: bool = False) -> None:
    """`show_output` of every node launcher at once (whole lines, each node's tagged); `raw`:
    one node's untagged output, your script's (`show_raw_output`)."""
    import threading

    if raw:
        show_raw_output(procs[0], log)
        return
    if len(procs) == 1:
        show_output(procs[0], log)
        return
    threads = [threading.Thread(target=show_output, args=(proc, log), daemon=True) for proc in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def show_output(proc: subprocess.Popen, log: Path | None = None) -> None:
    """Stream the trainer's stdout and stderr as they come, less the launcher's line tags and
    its `ddpkit-summary {json}` and `ddpkit-progress {json}` lines (lines for programs reading
    logs: the readable summary is printed from metrics.jsonl at the end, and `ddpkit status
    RUN_DIR` reads the progress); every line, tagged, is appended to `log`."""
    import threading

    lock = threading.Lock()
    kept = log.open("ab") if log is not None else None

    def copy(stream, out) -> None:
        for raw in stream:
            if kept is not None:
                with lock:
                    kept.write(raw)
                    kept.flush()
            tag = read_node_line_tag(raw[:32].decode("ascii", "replace"))
            text = raw[tag[2]:] if tag else raw  # the tag is ASCII: its length in bytes
            if not text.startswith((b"ddpkit-summary ", b"ddpkit-progress ")):
                out.write(text)
                out.flush()

    _copy_both(proc, copy)
    if kept is not None:
        kept.close()


def _copy_both(proc: subprocess.Popen, copy) -> None:
    """`copy(stream, out)` for the child's stdout and stderr at once, each in a thread, until both end."""
    import threading

    streams = [(s, out) for s, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))
               if s is not None]
    threads = [threading.Thread(target=copy, args=pair, daemon=True) for pair in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def show_raw_output(proc: subprocess.Popen, log: Path | None) -> None:
    """Your script's output on one node, passed on as it comes (chunks, not lines: a progress bar
    that redraws with `\r` stays live), and kept in `log` in whole lines tagged as the launcher
    tags a Slurm node's (`[0/R] `: the rank where the line names it, torch's `[rankR]:`, else
    `-`), so `ddpkit logs RUN_DIR` (`--all`, `--grep`, `--attempt`) reads it as the trainer's."""
    import threading

    lock = threading.Lock()
    kept = log.open("ab") if log is not None else None

    def copy(stream, out) -> None:
        pending = b""
        while chunk := os.read(stream.fileno(), 65536):
            out.write(chunk)
            out.flush()
            pending += chunk
            whole, _, pending = pending.rpartition(b"\n")
            if whole and kept is not None:
                with lock:
                    kept.write(_tagged(whole + b"\n"))
                    kept.flush()
        if pending and kept is not None:
            with lock:
                kept.write(_tagged(pending + b"\n"))

    _copy_both(proc, copy)
    if kept is not None:
        kept.close()


def _tagged(lines: bytes) -> bytes:
    """Each line of `lines` started with node 0's tag and the rank it names (or `-`)."""
    return b"".join(node_line_tag(0, line_worker_rank(line.decode("utf-8", "replace"))).encode() + line
                    for line in lines.splitlines(keepends=True))


def _own_source() -> list[str]:
    """ddpkit's own source directory when it is imported from the current directory (a checkout
    used without installing it): the launcher, started in the workdir's copy, must still find it."""
    import trainer

    source = Path(trainer.__file__).resolve().parent.parent
    return [str(source)] if source == Path.cwd().resolve() else []


def run_local(job, job_path: str, nproc: int | None = None) -> int:
    """Train `job` as its nodes' launchers, `nproc` processes each, through `trainer.launch`;
    return the run's exit code (node 0's, else the first node's that failed)."""
    nproc = nproc if nproc is not None else job.nproc_per_node
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: give at least 1 process")
    nodes = job.nodes.max
    snapshot = workdir.snapshot(job)  # a bad tree: refused before anything is written
    run_dir = run_dir_of(job)
    cwd = None
    if snapshot is not None:
        cwd, _ = snapshot.write(Path(job.train.output_dir), job.name)
        job = job.model_copy(update={"train": job.train.model_copy(
            update={"output_dir": str(Path(job.train.output_dir).absolute())})})
    job_file = write_effective_job(job, run_dir)
    port = free_port()
    offset = metrics_size(run_dir)
    what = job.script or job.module or f"{job.name} ({job_path})"
    shape = f"{nodes} local nodes x {nproc} processes" if nodes > 1 else f"{nproc} local processes"
    print(f"ddpkit: training {what} as {shape}; run dir {run_dir}", file=sys.stderr, flush=True)
    if snapshot is not None:
        print(f"ddpkit: workdir {snapshot.root} ({snapshot.describe()}) runs from its copy {cwd}",
              file=sys.stderr, flush=True)
    own_code = job.script is not None or job.module is not None  # its output as it is, unbuffered
    procs = []
    for node, cpus in enumerate(node_cpus(nodes)):
        env = launch_env(job, job_file, nproc, port, nodes, node)
        if snapshot is not None:
            env.update(workdir.record_env(snapshot))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), *_own_source()]))
        if not own_code or nodes > 1:  # the trainer's lines (every node's: tagged), kept in the run directory
            env[LINE_TAGS_VAR] = "1"
        if own_code:  # its output as it is: no record lines in it (`status` reads the run directory)
            env[PROGRESS_LINES_VAR] = "0"
        procs.append(subprocess.Popen(
            [sys.executable, *LAUNCH_ARGV[1:]], env=env, start_new_session=True, cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=(lambda cpus=cpus: os.sched_setaffinity(0, cpus)) if cpus else None))

    def forward(signum: int, frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        with (run_dir / OUTPUT_LOG).open("a", encoding="utf-8") as fh:  # where a run begins
            fh.write(start_line(job.name, nproc, nodes))
        show_outputs(procs, run_dir / OUTPUT_LOG, raw=own_code and nodes == 1)
        codes = [proc.wait() for proc in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    rc = codes[0] if codes[0] != 0 else next((c for c in codes if c != 0), 0)
    if job.script is not None or job.module is not None:  # the user's code: no trainer summary
        if rc in (EXIT_STOPPED, EXIT_STOPPED_UNSAVED):  # a script says nothing of checkpoints: 137
            print("ddpkit: stopped by a signal", file=sys.stderr)
        return rc
    summary = read_summary(run_dir, offset)
    if summary is not None and rc in (0, EXIT_STOPPED):
        print(f"\n{job.name}: {summary.get('status')}\n{format_summary(summary)}", flush=True)
    if rc == EXIT_STOPPED:
        print(f"ddpkit: stopped after a checkpoint; run the same command again to resume "
              f"(checkpoints in {summary.get('checkpoint_dir') if summary else run_dir})", file=sys.stderr)
    elif rc == EXIT_STOPPED_UNSAVED:
        print("ddpkit: stopped before a checkpoint could be written; run the same command again "
              "to resume from the previous checkpoint", file=sys.stderr)
    elif rc == 0 and summary is None:
        print("ddpkit: nothing to train (the job had already finished); delete the FINISHED "
              "marker in its checkpoint directory to train further", file=sys.stderr)
    return rc
