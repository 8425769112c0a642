"""The cyclic garbage collector paused while a process imports torch and dptrain's training code.

Importing torch, ``torch._dynamo`` and the training loop makes hundreds of thousands of objects the collector tracks
(496,919 for the test suite's fork-server list), nearly all alive for the process's life; while they are made, each
full collection walks every one made so far, over and over. Paused, ``import dptrain.run`` (torch, ``torch._dynamo``,
the training loop) takes a seventh less CPU (median per-round ratio 0.86; medians 2.39 against 3.06 s), and a fork
server's preload 0.85 (2.38 against 3.14 s), 8 alternated rounds: ``python docs/repro/import_cost.py``,
bench_results/import_cost.txt. What the imports leave as cyclic garbage (8,693 unreachable objects, by
``gc.collect()``'s count, after the preload) is collected by the first collection after the pause, or, in a fork
server, frozen with the rest (:mod:`dptrain.launch.frozen`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector's state before it is restored after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
