"""Stop glibc from handing gradient-sized memory back to the OS every step (CPU training).

A CPU training step allocates and frees activations and gradients of several MiB each.
With glibc's default settings, blocks above the (adaptive) mmap threshold come from
fresh ``mmap()`` and go back with ``munmap()`` when freed, and free memory at the top
of the heap is trimmed back to the OS; either way the next step writes to fresh pages
and pays a page fault (and the kernel's zeroing) for every 4 KiB. For the 16M-parameter
MLP of ``dptrain.bench.ddp`` that was about 15,500 page faults and 1.5-1.7x the step
time, with or without data parallelism, whichever DDP engine is used, in the processes
where it happened at all (it depends on heap layout; see docs/benchmarks.md).

:func:`tune_cpu_allocator` raises glibc's trim threshold to 1 GiB and pins its mmap
threshold at the maximum (32 MiB on 64-bit), so freed blocks are kept and reused.
Peak memory does not grow (the process reuses what it already had), but memory freed
late in a run is returned to the OS later. It changes a process-wide setting, so
dptrain never calls it behind your back: its launchers, test harness and benchmarks
call it in the worker processes they start, and a script of yours can call it first
thing. jemalloc or tcmalloc (``LD_PRELOAD``) are alternatives that avoid the problem too.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["tune_cpu_allocator"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_TRIM_THRESHOLD = 1 << 30
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: 4 MiB * sizeof(long)


def tune_cpu_allocator() -> bool:
    """Apply the settings above to this process; True if glibc accepted them.

    A no-op returning False where the C library is not glibc (macOS, musl).
    """
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim_ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return trim_ok and mmap_ok
