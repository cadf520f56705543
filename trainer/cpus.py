"""Bind each local rank of a CPU job to its own share of the node's CPUs (`train.bind_cpus`).

PyTorch's CPU performance guidance pins each training process to its own cores (its
`torch.backends.xeon.run_cpu` launcher does it per instance). For DDP on CPU the point is the
communication: gloo's threads of a rank then run on that rank's cores, which are free the
moment the rank blocks on the all-reduce. Unbound, `perf sched` showed a rank's collective thread
queued for 2-4 ms behind the other rank's compute while its own core sat idle, because it was
woken onto the busy one (bench/step_profile.py, `unbound` against `baseline`).

ddpkit's per-node launcher (trainer/launch/plan.py, torchrun mode) passes the CPUs it may use in
`DDPKIT_NODE_CPUS`; local rank i of n takes the i-th of n equal, contiguous shares, CPUs ordered
by core so that hyperthread siblings stay together (CPUs left over when n does not divide them
go unused by the ranks). Left to the scheduler, with the reason logged: one rank on the node; a
share smaller than the rank's threads; DataLoader workers (`train.num_workers` > 0: they would
share the rank's cores); a worker whose affinity is not the node's (something else bound it:
`taskset`, `numactl`, srun's per-task binding); a launcher other than ddpkit's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

NODE_CPUS_VAR = "DDPKIT_NODE_CPUS"  # trainer/launch/plan.py: the CPUs the node's launcher may use


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
