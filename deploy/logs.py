"""`ddpkit logs`: which lines of a job's output a person asked for, on every target.

One vocabulary (trainer/contract.py): `--rank N` is a node rank everywhere (a pod on
Kubernetes, a node's lines of the job's one file on Slurm; default 0), `--worker-rank R` one
process (global rank R: on Slurm the lines tagged with it, on Kubernetes the lines of its
node's pod that name it), `--all` every node, each line starting `[NODE/RANK] ` (`-` where a
line names no worker: torchrun, the launcher, the trainer's rank-0 records), `--grep` a regular
expression the printed line must match. The targets read the lines where they keep them
(deploy/slurm/submit.py, deploy/k8s/submit.py); this module only decides which to print.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deploy.errors import RuntimeFailure, UserError
from trainer.contract import line_worker_rank, node_line_tag, read_node_line_tag

Pick = Callable[[str], "str | None"]


@dataclass(frozen=True)
class Query:
    """What `ddpkit logs` was asked for (the CLI's options, the API's arguments)."""

    rank: int | None = None  # node rank; None: 0 unless `every` or `worker_rank`
    worker_rank: int | None = None  # global rank of one process
    every: bool = False  # --all: every node, lines tagged [NODE/RANK]
    grep: str | None = None  # a regular expression (Python `re`, searched in the printed line)
    attempt: int | None = None  # an earlier start (Slurm, local) by number, from 0
    previous: bool = False  # the start (Slurm, local) or the container (Kubernetes) before this one

    def __post_init__(self) -> None:
        if sum((self.rank is not None, self.worker_rank is not None, self.every)) > 1:
            raise UserError("--rank, --worker-rank and --all each say which lines: give one")
        if self.attempt is not None and self.previous:
            raise UserError("--attempt and --previous each say which attempt: give one")
        if self.attempt is not None and self.attempt < 0:
            raise UserError(f"--attempt {self.attempt}: attempts are numbered from 0")
        if self.grep is not None:
            try:
                re.compile(self.grep)
            except re.error as err:
                raise UserError(f"--grep {self.grep!r} is not a regular expression: {err}") from None

    @property
    def node(self) -> int:
        return 0 if self.rank is None else self.rank

    def matches(self, text: str) -> bool:
        return self.grep is None or re.search(self.grep, text) is not None


#: The line a start of the job writes first: the sbatch script's (`restart K`: Slurm's requeue
#: count; the output file is opened for appending, so every start is in it) and `ddpkit run
#: --local`'s in RUN_DIR/output.log. An attempt is what one start wrote.
START_LINE = re.compile(r"^ddpkit: \S+ \((?:job \d+, restart \d+|run --local)\)", re.M)


def attempt_text(text: str, query: Query, what: str) -> str:
    """The part of a log that `query.attempt` (or `query.previous`) asks for: from its start
    line to the next one (attempt 0 also has what came before its start line). `what` names
    the log in the error."""
    starts = [m.start() for m in START_LINE.finditer(text)] or [0]
    starts[0] = 0
    want = len(starts) - 2 if query.previous else query.attempt
    if want is None:
        return text
    if not 0 <= want < len(starts):
        have = f"attempts 0..{len(starts) - 1}" if len(starts) > 1 else "one attempt only (0)"
        raise UserError(f"{what} holds {have}: no {'previous attempt' if query.previous else f'attempt {want}'}")
    return text[starts[want]:starts[want + 1] if want + 1 < len(starts) else len(text)]


def pick_tagged(query: Query) -> Pick:
    """For a file several nodes write, each line tagged by `trainer.launch` (Slurm): the lines
    `query` asks for, as printed (the tag kept with --all, else dropped; untagged lines, the
    batch shell's own or a log from before the tags, always)."""

    def pick(line: str) -> str | None:
        tag = read_node_line_tag(line)
        if tag is None:
            shown = line
        else:
            node, named, begins = tag
            if query.every:
                shown = line
            elif query.worker_rank is not None:
                shown = line[begins:] if named == query.worker_rank else None
            else:
                shown = line[begins:] if node == query.node else None
        return shown if shown is not None and query.matches(shown) else None

    return pick


def pick_node(query: Query, node: int, nproc: int) -> Pick:
    """For one node's own log (a pod's): the lines `query` asks for; with --all each starts
    `[NODE/RANK] ` (the rank the line names, else `-`), with --worker-rank only the lines that
    name it (every line where the node runs one process)."""

    def pick(line: str) -> str | None:
        named = line_worker_rank(line)
        if query.every:
            shown = node_line_tag(node, named) + line
        elif query.worker_rank is not None and nproc > 1:
            shown = line if named == query.worker_rank else None
        else:
            shown = line
        return shown if shown is not None and query.matches(shown) else None

    return pick


class LineWriter:
    """Writes the chunks it is given to `out` as whole lines, each through `pick` (None: not
    printed); `close()` passes a last line without a newline. Safe to share between threads
    (each thread its own LineWriter, one lock for `out`)."""

    def __init__(self, out, pick: Pick, lock: threading.Lock | None = None):
        self.out, self.pick, self.lock = out, pick, lock or threading.Lock()
        self.pending = ""

    def write(self, chunk: str) -> None:
        *lines, self.pending = (self.pending + chunk).split("\n")
        shown = [text for line in lines if (text := self.pick(line + "\n")) is not None]
        if shown:
            with self.lock:
                self.out.write("".join(shown))
                self.out.flush()

    def close(self) -> None:
        if self.pending:
            text, self.pending = self.pick(self.pending), ""
            if text is not None:
                with self.lock:
                    self.out.write(text)
                    self.out.flush()


def print_file(path: Path, lines: LineWriter, query: Query, *, follow: bool, ended: Callable[[], bool],
               poll_s: float, missing: str) -> int:
    """What `query` asks of a file one job appends to (a Slurm job's output file, a local run's
    output.log): an earlier start's part (`--attempt`, `--previous`), or the file as it is and,
    with `follow`, what it gains until `ended()`, then the rest. `missing`: the error when the
    file is not there (yet)."""
    if query.attempt is not None or query.previous:  # an earlier start: it has ended
        if not path.exists():
            raise RuntimeFailure(missing)
        lines.write(attempt_text(path.read_text(encoding="utf-8", errors="replace"), query, str(path)))
        lines.close()
        return 0
    position = 0
    while True:
        if path.exists():
            position = _write_from(path, position, lines)
        elif not follow:
            raise RuntimeFailure(missing)
        if not follow or ended():
            if follow and path.exists():  # what was written after the last read
                _write_from(path, position, lines)
            lines.close()
            return 0
        time.sleep(poll_s)


def _write_from(path: Path, position: int, lines: LineWriter) -> int:
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        fh.seek(position)
        lines.write(fh.read())
        return fh.tell()
