"""`ddpkit status --watch HANDLE...`: a live table of one or more jobs, refreshed in place
(rich's `Live`) until every job has ended; Ctrl-C leaves it. On a terminal that is not one
(a pipe, a CI log), each refresh prints the plain status lines instead."""

from __future__ import annotations

import sys
import time
from typing import Any

from deploy.kube import TERMINAL_STATES
from deploy.progress import Report, duration, step_of


def table(rows: list[tuple[str, Report]], now: float) -> Any:
    from rich.table import Table

    out = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("job", "state", "step", "epoch", "samples/s", "ETA", "goodput", "restarts",
                   "rank steps/s", "updated"):
        out.add_column(column, justify="right" if column not in ("job", "state") else "left")
    for handle, report in rows:
        r = report.record or {}
        running = r.get("state") == "running"
        out.add_row(
            handle, report.state_line,
            step_of(r) if r else "",
            f"{min(r.get('epoch', 0) + 1, r.get('epochs', 0))}/{r.get('epochs')}" if r.get("epochs") else "",
            f"{r['samples_per_s']:.0f}" if r.get("samples_per_s") else "",
            duration(r["eta_s"]) if running and r.get("eta_s") is not None else "",
            f"{100 * r['run']['goodput']:.0f}%" if (r.get("run") or {}).get("goodput") is not None else "",
            f"{r.get('restarts', 0)}/{r.get('restarts_allowed', 0)}" if r else "",
            rank_rates(r),
            f"{duration(now - r['updated'])} ago" if r else "",
        )
    return out


def rank_rates(record: dict[str, Any]) -> str:
    """Each rank's steps/s over the last window (`0:4.1 1:2.0`), the straggler marked `!`."""
    slow = (record.get("straggler") or {}).get("rank")
    return " ".join(f"{x['rank']}:{x['steps_per_s']:.1f}" + ("!" if x["rank"] == slow else "")
                    for x in record.get("ranks") or [] if x.get("steps_per_s"))


def watch(handles: list[Any], *, every_s: float = 2.0) -> int:
    """Refresh until every job is in a terminal state; 0. (`handles`: `deploy.api.Handle`s.)
    Each refresh also tends the jobs that still run (`Handle.tend`: on Kubernetes, keep a job's
    pods off the nodes lost under it), and the last one those that have ended; what that
    did is shown once, above the table."""
    every_s = max(0.2, every_s)
    said: set[str] = set()

    def rows() -> list[tuple[str, Report]]:
        return [(h.text, h.report()) for h in handles]

    def ended(current: list[tuple[str, Report]]) -> bool:
        return all(report.state in TERMINAL_STATES for _, report in current)

    def tended(current: list[tuple[str, Report]]) -> list[str]:
        last = ended(current)
        lines = [line for h, (_, report) in zip(handles, current, strict=True)
                 if last or report.state not in TERMINAL_STATES
                 for line in h.tend(ended=report.state in TERMINAL_STATES) if line not in said]
        said.update(lines)
        return lines

    current = rows()
    if not sys.stdout.isatty():
        while True:
            for line in tended(current):
                print(line, flush=True)
            for handle, report in current:
                print(f"{handle}  {report.text()}", flush=True)
            if ended(current):
                return 0
            time.sleep(every_s)
            current = rows()
    from rich.live import Live

    try:
        with Live(table(current, time.time()), auto_refresh=False) as live:
            while True:
                for line in tended(current):
                    live.console.print(line)
                if ended(current):
                    break
                time.sleep(every_s)
                current = rows()
                live.update(table(current, time.time()), refresh=True)
    except KeyboardInterrupt:
        return 130
    return 0
