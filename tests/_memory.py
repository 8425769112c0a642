"""What a process holds now, for the soak tests: its resident set, and the bytes its C heap holds in use."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
HAS_MALLINFO2 = hasattr(_LIBC, "mallinfo2")  # glibc 2.33 or later


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def resident_mib() -> float:
    """This process's resident set now (not its peak), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def heap_mib() -> float:
    """The MiB this process's C heap holds in use now, every arena's and every mmapped block's (glibc's
    ``mallinfo2``): tensors' storage and every object, as allocated, whatever of it the allocator keeps resident or
    hands back, so a kept payload shows at once and the pages glibc keeps or trims do not. (Free holes the
    allocator cannot reuse are not in it: the resident set shows those.)"""
    _LIBC.mallinfo2.restype = _MallInfo2
    info = _LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20
