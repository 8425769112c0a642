"""How many threads each worker computes with: the cores shared among the workers, or ``OMP_NUM_THREADS``.

No torch here: the launchers use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["threads_per_worker", "omp_threads", "omp_warning"]


def threads_per_worker(workers: int) -> int:
    """This machine's cores shared by ``workers`` processes (at least 1 each): N workers with every core's
    threads each would fight over the cores."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def omp_threads(environ: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` when it is a positive whole number; None when unset or not one (``abc``, empty, 0, -3).

    torch and torchrun tolerate such a value (the OpenMP runtime says "Invalid value" and uses its
    default); so does dptrain: it is then treated as unset.
    """
    value = environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def omp_warning(environ: Mapping[str, str]) -> str | None:
    """The line a launcher prints once when ``OMP_NUM_THREADS`` is set to something that is not a thread count."""
    if "OMP_NUM_THREADS" not in environ or omp_threads(environ) is not None:
        return None
    return (f"warning: OMP_NUM_THREADS={environ['OMP_NUM_THREADS']!r} is not a positive whole number: ignored (each "
            "worker computes with its share of the cores, as without it)")
