"""Run gloo's TCP event loop at idle priority (`train.gloo_loop_idle`).

gloo (torch's CPU backend) moves bytes on one event-loop thread per device, named
`gloo_tcp_loop`, while the collective itself runs on torch's `pt_gloo_runloop` threads. When
data arrives on a connection whose lock the collective's thread holds (it sends in place, under
that lock), the loop skips the event and calls `epoll_wait` again at once, which reports the
same event: it spins until the lock is free (pytorch/gloo#246, open). Measured here on a 2-rank
all-reduce of the `cnn` gradients (1 MiB): about 930 `epoll_wait` calls per all-reduce, the
loop thread at 45-50% of a core, and on a machine with as many cores as ranks the spinning
thread is often queued before the thread it waits for, which then runs only at the next
scheduler tick (3-4 ms later).

At `SCHED_IDLE` the loop gets only the CPU time no other thread of the job wants: the lock
holder runs first and the spin ends. Measured on the 2-core test machine: the same all-reduce
back to back, 1.66 -> 0.64 ms; inside the 2-rank `cnn` step (bench/step_profile.py,
`gloo_loop_normal` against `baseline`, 6 interleaved repeats), the all-reduce time the backward
could not hide went from 4.7 to 2.9 ms a step and samples/s rose 1.12x. Results do not change:
only when the thread runs does (tests/test_trainer.py's bit-for-bit comparison runs with it).

The trade-off: the loop runs only when a core has nothing else to do. In a training step the
ranks' own threads block on the all-reduce, so it does; but when another CPU-bound process
shares the cores without a cgroup of its own (SCHED_IDLE is relative within a cgroup, and a
Kubernetes pod or a Slurm job with task/cgroup has its own), the loop waits for it. Set
`train.gloo_loop_idle: false` there. Only the DDP group on CPU (gloo) is touched; with nccl
nothing is.
"""

from __future__ import annotations

import os
import sys

LOOP_THREAD = "gloo_tcp_loop"  # the name torch's bundled gloo gives its TCP event-loop threads


def loop_threads() -> list[int]:
    """Thread ids of this process's gloo event loops (none off Linux or before the first group)."""
    tids = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return tids
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == LOOP_THREAD:
                    tids.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return tids


def idle_gloo_loops() -> str:
    """Put every gloo event-loop thread of this process at SCHED_IDLE; what was done, for the log."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None or not sys.platform.startswith("linux"):
        return "gloo event loop left alone (not Linux)"
    done, refused = 0, ""
    for tid in loop_threads():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done += 1
        except OSError as e:  # a seccomp profile that forbids it; or the thread is gone
            refused = e.strerror or str(e)
    if refused and not done:
        return f"gloo event loop left alone (sched_setscheduler: {refused})"
    if not done:
        return f"gloo event loop left alone (no {LOOP_THREAD} thread in this process)"
    return f"gloo event loop at idle priority ({done} thread(s), SCHED_IDLE): it spins while it waits"
