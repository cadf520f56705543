"""Keep the memory a training step frees for the next step (`train.keep_freed_memory`).

A CPU step allocates and frees the same activations and gradients every step. With glibc's
defaults, malloc serves a block above its mmap threshold with a fresh `mmap` and gives the
free top of the heap back to the kernel once it exceeds the trim threshold (both thresholds
move with what was freed last), so the next step page-faults the same megabytes in again.
Measured on the `cnn` workload (batch 64, 2-core test machine): 2,000-3,700 minor page faults
per step with the defaults, 8-17 with fixed thresholds (`tests/test_malloc.py` counts them);
in a 2-rank run, 30,000-140,000 faults per second per rank, a fifth of a core in the kernel.

The fix is the one PyTorch's CPU performance notes reach for with jemalloc or tcmalloc, done
with glibc's own knobs (`mallopt`, the same as the `GLIBC_TUNABLES` `glibc.malloc.*` settings,
but applied by the worker itself, so every launch mode gets it, warm forks included): blocks
up to 32 MiB (glibc's largest mmap threshold) come from the heap, and up to 128 MiB of free
heap top stays mapped. Cost: a rank's resident memory does not fall back below its peak plus
at most 128 MiB after a phase that allocated more (evaluation, a checkpoint); the peak itself
is unchanged. A job that sets `GLIBC_TUNABLES` with `glibc.malloc.` settings, or
`MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_`, keeps its own. No-op off glibc (musl's
mallopt does nothing; with jemalloc/tcmalloc preloaded, their mallopt ignores these).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping

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
