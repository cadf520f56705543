"""CPU (gloo) runs only: what a rank on a CPU sets up for itself, in one place. trainer/train.py
calls it when the device is a CPU; a GPU run never enters this module.

- `train.keep_freed_memory`: the memory a step frees stays for the next step (`keep_freed_memory`).
- `train.bind_cpus`: each local rank on its own share of the node's CPUs (`bind_local_rank`).
- `train.gloo_loop_idle`: gloo's TCP event loop at idle priority (`idle_gloo_loops`).

`tune_rank` applies the first two, before gloo and torch start their threads; `tune_gloo` the
third, once DDP's broadcast at construction has started gloo's threads. Each says what it did in
one log line (`memory: ...`, `cpus: ...`, `DDP: ...`). Why each exists is in its section below;
the measurements that chose them are bench/'s.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from trainer.contract import NODE_CPUS_VAR, format_cpus, parse_cpus

log = logging.getLogger("ddpkit.trainer")


def tune_rank(cfg: Any, local_rank: int, local_world: int, threads: int) -> None:
    """`train.keep_freed_memory` and `train.bind_cpus` for this rank (`threads`: torch's)."""
    if cfg.keep_freed_memory:
        log.info("memory: %s", keep_freed_memory(os.environ))
    if cfg.bind_cpus:
        log.info("cpus: %s", bind_local_rank(os.environ, local_rank, local_world, threads, cfg.num_workers))


def tune_gloo(cfg: Any, is_main: bool) -> None:
    """`train.gloo_loop_idle`, after DDP's construction started gloo's threads."""
    if cfg.gloo_loop_idle:
        note = idle_gloo_loops()
        if is_main:
            log.info("DDP: %s", note)


# -- train.keep_freed_memory ----------------------------------------------------------------------
# Keep the memory a training step frees for the next step (`train.keep_freed_memory`).
#
# A CPU step allocates and frees the same activations and gradients every step. With glibc's
# defaults, malloc serves a block above its mmap threshold with a fresh `mmap` and gives the
# free top of the heap back to the kernel once it exceeds the trim threshold (both thresholds
# move with what was freed last), so the next step page-faults the same megabytes in again.
# Measured on the `cnn` workload (batch 64, 2-core test machine): 2,000-3,700 minor page faults
# per step with the defaults, 8-17 with fixed thresholds (`tests/test_malloc.py` counts them);
# in a 2-rank run, 30,000-140,000 faults per second per rank, a fifth of a core in the kernel.
#
# The fix is the one PyTorch's CPU performance notes reach for with jemalloc or tcmalloc, done
# with glibc's own knobs (`mallopt`, the same as the `GLIBC_TUNABLES` `glibc.malloc.*` settings,
# but applied by the worker itself, so every launch mode gets it, warm forks included): blocks
# up to 32 MiB (glibc's largest mmap threshold) come from the heap, and up to 128 MiB of free
# heap top stays mapped. Cost: a rank's resident memory does not fall back below its peak plus
# at most 128 MiB after a phase that allocated more (evaluation, a checkpoint); the peak itself
# is unchanged. A job that sets `GLIBC_TUNABLES` with `glibc.malloc.` settings, or
# `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_`, keeps its own. No-op off glibc (musl's
# mallopt does nothing; with jemalloc/tcmalloc preloaded, their mallopt ignores these).

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 128 << 20


def users_malloc_setting(env: Mapping[str, str]) -> str | None:
    """The environment variable by which the job tuned malloc itself, if any."""
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return next((v for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if env.get(v)), None)


def keep_freed_memory(env: Mapping[str, str]) -> str:
    """Fix glibc's thresholds in this process (see the module docstring); what was done, for the log."""
    own = users_malloc_setting(env)
    if own:
        return f"malloc left as the job set it ({own})"
    if not sys.platform.startswith("linux"):
        return "malloc left alone (not Linux)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "malloc left alone (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "malloc left alone (mallopt refused the thresholds)"
    return (f"freed memory kept for reuse (malloc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
            f"trim threshold {TRIM_THRESHOLD >> 20} MiB)")


# -- train.bind_cpus ------------------------------------------------------------------------------
# Bind each local rank of a CPU job to its own share of the node's CPUs (`train.bind_cpus`).
#
# PyTorch's CPU performance guidance pins each training process to its own cores (its
# `torch.backends.xeon.run_cpu` launcher does it per instance). For DDP on CPU the point is the
# communication: gloo's threads of a rank then run on that rank's cores, which are free the
# moment the rank blocks on the all-reduce. Unbound, `perf sched` showed a rank's collective thread
# queued for 2-4 ms behind the other rank's compute while its own core sat idle, because it was
# woken onto the busy one (bench/step_profile.py, `unbound` against `baseline`).
#
# ddpkit's per-node launcher (trainer/launch/plan.py, torchrun mode) passes the CPUs it may use in
# `DDPKIT_NODE_CPUS`; local rank i of n takes the i-th of n equal, contiguous shares, CPUs ordered
# by core so that hyperthread siblings stay together (CPUs left over when n does not divide them
# go unused by the ranks). Left to the scheduler, with the reason logged: one rank on the node; a
# share smaller than the rank's threads; DataLoader workers (`train.num_workers` > 0: they would
# share the rank's cores); a worker whose affinity is not the node's (something else bound it:
# `taskset`, `numactl`, srun's per-task binding); a launcher other than ddpkit's.

def core_of(cpu: int, sysfs: str = "/sys/devices/system/cpu") -> tuple[int, int]:
    """(package, core) of a CPU from sysfs; (0, cpu) when not known."""
    try:
        base = f"{sysfs}/cpu{cpu}/topology"
        return int(open(f"{base}/physical_package_id").read()), int(open(f"{base}/core_id").read())
    except (OSError, ValueError):
        return 0, cpu


def shares(cpus: Iterable[int], ranks: int) -> list[list[int]]:
    """`ranks` equal, contiguous shares of `cpus` ordered by core (siblings together)."""
    ordered = sorted(cpus, key=lambda c: (*core_of(c), c))
    per = len(ordered) // ranks
    return [ordered[i * per:(i + 1) * per] for i in range(ranks)]


def bind_local_rank(env: Mapping[str, str], local_rank: int, local_world: int, threads: int,
                    num_workers: int) -> str:
    """Bind every thread of this process (and so every later one) to its share; what was done."""
    text = env.get(NODE_CPUS_VAR, "")
    left = "CPUs left to the scheduler"
    if not text or not hasattr(os, "sched_setaffinity"):
        return f"{left} (not started by ddpkit's per-node launcher)"
    if local_world < 2:
        return f"{left} (one rank on this node)"
    if num_workers > 0:
        return f"{left} (train.num_workers {num_workers}: DataLoader workers need cores of their own)"
    node = parse_cpus(text)
    if sorted(os.sched_getaffinity(0)) != node:
        return f"{left} (this worker is already bound to CPUs {format_cpus(os.sched_getaffinity(0))})"
    mine = shares(node, local_world)[local_rank]
    if len(mine) < threads:
        return f"{left} ({len(node)} CPUs for {local_world} ranks of {threads} thread(s) each)"
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:  # the thread ended meanwhile
            continue
    return (f"local rank {local_rank} bound to CPUs {format_cpus(mine)} ({len(mine)} of the node's "
            f"{len(node)}, one share per local rank)")


# -- train.gloo_loop_idle -------------------------------------------------------------------------
# Run gloo's TCP event loop at idle priority (`train.gloo_loop_idle`).
#
# gloo (torch's CPU backend) moves bytes on one event-loop thread per device, named
# `gloo_tcp_loop`, while the collective itself runs on torch's `pt_gloo_runloop` threads. When
# data arrives on a connection whose lock the collective's thread holds (it sends in place, under
# that lock), the loop skips the event and calls `epoll_wait` again at once, which reports the
# same event: it spins until the lock is free (pytorch/gloo#246, open). Measured here on a 2-rank
# all-reduce of the `cnn` gradients (1 MiB): about 930 `epoll_wait` calls per all-reduce, the
# loop thread at 45-50% of a core, and on a machine with as many cores as ranks the spinning
# thread is often queued before the thread it waits for, which then runs only at the next
# scheduler tick (3-4 ms later).
#
# At `SCHED_IDLE` the loop gets only the CPU time no other thread of the job wants: the lock
# holder runs first and the spin ends. Measured on the 2-core test machine: the same all-reduce
# back to back, 1.66 -> 0.64 ms; inside the 2-rank `cnn` step (bench/step_profile.py,
# `gloo_loop_normal` against `baseline`, 6 interleaved repeats), the all-reduce time the backward
# could not hide went from 4.7 to 2.9 ms a step and samples/s rose 1.12x. Results do not change:
# only when the thread runs does (tests/test_trainer.py's bit-for-bit comparison runs with it).
#
# The trade-off: the loop runs only when a core has nothing else to do. In a training step the
# ranks' own threads block on the all-reduce, so it does; but when another CPU-bound process
# shares the cores without a cgroup of its own (SCHED_IDLE is relative within a cgroup, and a
# Kubernetes pod or a Slurm job with task/cgroup has its own), the loop waits for it. Set
# `train.gloo_loop_idle: false` there. Only the DDP group on CPU (gloo) is touched; with nccl
# nothing is.

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
