"""This process's own facts, read from the kernel: when it started, and its peak resident memory."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

__all__ = ["peak_rss_mb", "process_start"]


def peak_rss_mb() -> float:
    """This process's peak resident set so far (MiB): tensors, libraries, the allocator's cache."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def process_start() -> float | None:
    """When this process started (wall clock), from /proc: a restarted worker's rejoin is timed from it."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
