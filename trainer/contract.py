"""The launch contract: what every target hands `python -m trainer.launch`, as one type.

Standard library only: `deploy` (the renderers, `run --local`, submitit) and `trainer` (the
launcher, the workers) both import it, and neither imports the other. Every fact that a
producer and a reader must agree on lives here once: the `DDPKIT_*` variable names
(`LaunchEnv`), the exit codes after a stop, the default rendezvous port, the stop grace, the
launch command, and the Slurm port formula. docs/CONTRACT.md says the same in prose.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

#: torchrun's and Kubeflow Trainer's default rendezvous port (JobSet and Indexed Job use it too).
DEFAULT_PORT = 29500
#: Seconds between SIGTERM and SIGKILL when the target says nothing: ddpkit's default
#: terminationGracePeriodSeconds and Slurm signal lead. torchrun gets it as --shutdown-timeout.
DEFAULT_STOP_GRACE_S = 120

EXIT_OK = 0
EXIT_FAILURE = 1
#: A bad job file, a bad launch environment, a missing script: retrying cannot help.
EXIT_BAD_CONFIG = 2
#: Stopped by a signal after every rank's stop checkpoint was complete (128 + SIGTERM).
EXIT_STOPPED = 143
#: Stopped by a signal with no checkpoint of that moment (killed mid-step or mid-save, or
#: stopped before training began): what SIGKILL gives (128 + 9). A restart resumes from the
#: previous checkpoint. Both stop codes are in Kubeflow's ExitCode policy's retryable range.
EXIT_STOPPED_UNSAVED = 137
#: The hang watchdog ended the attempt (trainer/watchdog.py): a rank stopped making progress.
#: timeout(1)'s code; under torchrun the group restarts while `restarts` are left.
EXIT_HANG = 124
#: The line a hang verdict is logged on, its JSON after the prefix (the watchdog, and the
#: launcher for a script job: trainer/guard.py); `ddpkit why` reads it from any node's log.
HANG_VERDICT_PREFIX = "ddpkit-hang "

#: The stop signals torchrun passes on to its workers (the launcher's `--signals-to-handle`), and
#: so a warm worker's client to its worker (trainer/warm.py); the line relay ignores them.
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR2")

#: The node-level entry point every target starts (the container image has `python`).
LAUNCH_MODULE = "trainer.launch"
LAUNCH_ARGV = ("python", "-m", LAUNCH_MODULE)
#: The same, as one would type it (messages that tell the user how to start a node).
LAUNCH_COMMAND = " ".join(LAUNCH_ARGV)

#: Slurm: a port per job so that jobs sharing a node do not collide on one port.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 10000


def slurm_port(job_id: int) -> int:
    """The rendezvous port of Slurm job `job_id`; the sbatch script's bash says the same:
    `$((SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN))`."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def slurm_port_bash(job_id_var: str = "SLURM_JOB_ID") -> str:
    """`slurm_port` as a bash arithmetic expansion, for the sbatch template."""
    return f"$(({SLURM_PORT_BASE} + {job_id_var} % {SLURM_PORT_SPAN}))"


@dataclass(frozen=True)
class LaunchEnv:
    """The `DDPKIT_*` variables a target sets for `trainer.launch` (docs/CONTRACT.md).

    The field order is the order renderers write them in. None means "not set by this target"
    (the launcher then reads the scheduler's own variables, `trainer.launch.plan.CONTEXTS`).
    """

    job_file: str | None = None
    run_id: str | None = None
    nnodes: str | None = None  # N, or MIN:MAX for an elastic job
    nproc_per_node: int | None = None
    max_restarts: int | None = None
    launcher: str | None = None  # torchrun (one task per node) | srun (one task per process)
    stop_grace_s: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def to_env(self) -> dict[str, str]:
        """The variables that are set, as strings, in field order."""
        return {var(f.name): str(value) for f in fields(self) if (value := getattr(self, f.name)) is not None}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LaunchEnv:
        """The contract as `env` carries it (unset or empty: None); ValueError names the
        variable whose value is not a number where one is needed."""
        values: dict[str, object] = {}
        for f in fields(cls):
            text = env.get(var(f.name)) or None
            if text is not None and f.type == "int | None":
                try:
                    text = int(text)
                except ValueError:
                    raise ValueError(f"{var(f.name)}={text!r} is not a number") from None
            values[f.name] = text
        return cls(**values)


def var(field_name: str) -> str:
    """The variable that carries `LaunchEnv.<field_name>`: `DDPKIT_<FIELD_NAME>`."""
    return "DDPKIT_" + field_name.upper()


# The variable of each `LaunchEnv` field, for readers that read one field (tests/test_contract.py
# checks that these are exactly `var()` of the fields).
JOB_FILE_VAR = var("job_file")
RUN_ID_VAR = var("run_id")
NNODES_VAR = var("nnodes")
NPROC_PER_NODE_VAR = var("nproc_per_node")
MAX_RESTARTS_VAR = var("max_restarts")
LAUNCHER_VAR = var("launcher")
STOP_GRACE_S_VAR = var("stop_grace_s")
MASTER_ADDR_VAR = var("master_addr")
MASTER_PORT_VAR = var("master_port")


#: Variables the launcher and the workers set for each other (not a target's to set).
LAUNCH_T0_VAR = "DDPKIT_LAUNCH_T0"  # when the node's launch began (time.time()): launch cost
TORCHRUN_T0_VAR = "DDPKIT_TORCHRUN_T0"  # when torchrun was started
STOP_FILE_VAR = "DDPKIT_STOP_FILE"  # a worker writes the checkpointed step here on a stop
#: Seconds a script job's launcher waits after a stop before it ends the ranks that write no
#: checkpoint (trainer/launch/script_stop.py; default 5): a script that needs longer to reach
#: its own save point sets it in the job's `env:`.
SCRIPT_STOP_S_VAR = "DDPKIT_SCRIPT_STOP_S"
CONTEXT_VAR = "DDPKIT_CONTEXT"  # the launch context trainer.launch detected
PREFLIGHT_ONLY_VAR = "DDPKIT_PREFLIGHT_ONLY"  # "1": run only the preflight checks
PROGRESS_LINES_VAR = "DDPKIT_PROGRESS_LINES"  # "0": no `ddpkit-progress` lines (run --local reads the file)
LINE_TAGS_VAR = "DDPKIT_LINE_TAGS"  # "1": tag each line (NODE_LINE_TAG) in any context (run --local)
RUN_DIR_VAR = "DDPKIT_RUN_DIR"  # a script job's run directory: where trainer.guard writes stacks
RANK_LINES_VAR = "DDPKIT_RANK_LINES"  # "0": a script job's lines without their `[rankR]:` (trainer/rank_lines.py)
WARM_VAR = "DDPKIT_WARM"  # "0": cold restarts; "1": warm even for a script/module (trainer/warm.py)
WARM_SOCKET_VAR = "DDPKIT_WARM_SOCKET"  # the node's template process (trainer/warm.py)
NODE_CPUS_VAR = "DDPKIT_NODE_CPUS"  # the CPUs the node's launcher may use (`format_cpus`; trainer/host.py)
#: What a `workdir:` job runs (deploy/workdir.py), set by every target beside the contract and
#: kept in the run's records: the tree's content hash (sha256, hex), the git commit it was
#: taken from (unset outside a git work tree) and "1" when the tree differed from that commit.
WORKDIR_HASH_VAR = "DDPKIT_WORKDIR_HASH"
WORKDIR_COMMIT_VAR = "DDPKIT_WORKDIR_COMMIT"
WORKDIR_DIRTY_VAR = "DDPKIT_WORKDIR_DIRTY"
#: How logs say which tree a run ran (`workdir_line`), for `status` and `why` to read back.
WORKDIR_LINE = re.compile(r"workdir sha256:([0-9a-f]{64})(?: git ([0-9a-f]{7,64}|\(no commit\)))?(?: \((dirty|clean)\))?")
# A template that outlives the job steps of a Slurm allocation: the prefix of its directory
# (`resident_socket`); a launcher uses it instead of its own (slurm/job.sh.j2 sets it).
RESIDENT_VAR = "DDPKIT_WARM_RESIDENT"

#: Fault injection, for tests only: set by the test suite, read by the workers.
STOP_AT_STEP_VAR = "DDPKIT_STOP_AT_STEP"  # act as if a stop signal came at step N
FAULT_CRASH_VAR = "DDPKIT_FAULT_CRASH"  # STEP:POINT: die at POINT of the save of STEP
FAULT_SAVE_DELAY_S_VAR = "DDPKIT_FAULT_SAVE_DELAY_S"  # a checkpoint write takes S seconds longer


#: How a log line names the worker (global rank) that printed it: torch's own `[rankR]:`
#: prefix (an uncaught exception in a process group), and the trainer's log format
#: `... ddpkit rank R LEVEL ...` (trainer/train.py).
WORKER_LINE_TAG = r"\[rank(\d+)\]:|\bddpkit rank (\d+) "

#: Where several nodes write one file (Slurm: the job's output file), `trainer.launch` starts
#: each line of its node with `[NODE/RANK] `: the node rank, and the worker's global rank
#: where the line says whose it is (srun mode: the task's rank; torchrun mode: the rank the
#: line names, WORKER_LINE_TAG), else `-` (torchrun, the launcher, an unnamed worker line).
#: The launcher reads whole lines before it writes them, so a long line stays one line
#: (`srun --label` cut them at its buffer size). `ddpkit logs` reads the tags back.
NODE_LINE_TAG = r"^\[(\d+)/(\d+|-)\] "


#: How a script job's worker starts each line it prints (trainer/rank_lines.py): torch's own.
WORKER_LINE_PREFIX = "[rank{rank}]: "


def line_worker_rank(line: str, start: int = 0) -> int | None:
    """The worker rank a log line names (WORKER_LINE_TAG), or None."""
    import re

    match = re.compile(WORKER_LINE_TAG).search(line, start)
    return int(match.group(1) or match.group(2)) if match else None


def node_line_tag(node: int, rank: int | None) -> str:
    """The tag `trainer.launch` starts a line with (NODE_LINE_TAG): `[1/3] `, `[1/-] `."""
    return f"[{node}/{'-' if rank is None else rank}] "


def read_node_line_tag(line: str) -> tuple[int, int | None, int] | None:
    """(node, worker rank or None, where the line's own text begins) of a tagged line; None for
    a line without the tag (the batch shell's own, a log written before tags)."""
    import re

    match = re.match(NODE_LINE_TAG, line)
    if match is None:
        return None
    rank = match.group(2)
    return int(match.group(1)), None if rank == "-" else int(rank), match.end()


def warm_worker_file(stop_file: str, client_pid: int) -> str:
    """Where a warm client (trainer/warm.py) leaves the pid of the worker the template forked for
    it: in the launcher's private directory of `DDPKIT_STOP_FILE`, which the launcher removes at
    its end. A script job's stop (trainer/launch/script_stop.py) reads and ends the worker, not
    the client, whose stacks say nothing of the rank's work."""
    return os.path.join(os.path.dirname(stop_file), f"warm-worker-{client_pid}")


def resident_socket(prefix: str, environ: Mapping[str, str]) -> str:
    """The socket of this node's resident template (`RESIDENT_VAR` holds `prefix`): a directory
    per node, named after Slurm's name for it (SLURMD_NODENAME, set in every job step), since
    nodes may share /tmp (a testbed's nodes in one host's namespaces, a /tmp on shared storage)
    and a node must never be handed another node's template."""
    import socket

    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
    return f"{prefix}-{node}/warm.sock"


def format_cpus(cpus: Iterable[int]) -> str:
    """`0-3,8,10-11`: the kernel's list format (as in `Cpus_allowed_list`, `taskset -c`)."""
    ids, parts = sorted(set(cpus)), []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpus(text: str) -> list[int]:
    """The inverse of `format_cpus`; ValueError on anything else."""
    out: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def workdir_record(env: Mapping[str, str]) -> dict[str, object] | None:
    """What a `workdir:` run runs, from the WORKDIR_* variables (None without a workdir): the
    tree's sha256, the git commit (None outside a git work tree or before its first commit)
    and whether the tree differed from it (None outside a git work tree)."""
    digest = env.get(WORKDIR_HASH_VAR)
    if not digest:
        return None
    dirty = env.get(WORKDIR_DIRTY_VAR)
    return {"sha256": digest, "commit": env.get(WORKDIR_COMMIT_VAR) or None,
            "dirty": None if dirty is None else dirty == "1"}


def workdir_line(record: Mapping[str, object]) -> str:
    """`workdir sha256:HASH git COMMIT (dirty)`: the record as one line of a log (WORKDIR_LINE)."""
    git = ""
    if record.get("dirty") is not None:
        git = f" git {record.get('commit') or '(no commit)'} ({'dirty' if record['dirty'] else 'clean'})"
    return f"workdir sha256:{record['sha256']}{git}"


def parse_workdir_line(text: str) -> dict[str, object] | None:
    """The first `workdir_line` in `text` as its record (None when there is none)."""
    found = WORKDIR_LINE.search(text)
    if found is None:
        return None
    commit = found[2] if found[2] and not found[2].startswith("(") else None
    return {"sha256": found[1], "commit": commit, "dirty": None if found[3] is None else found[3] == "dirty"}
