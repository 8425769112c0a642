"""The cyclic garbage collector paused while a process imports torch and dptrain's training code.

Importing torch, ``torch._dynamo`` and the training loop makes about 300,000 objects the collector tracks, nearly
all of them alive for the process's life; while they are made, each full collection walks every one made so far,
over and over. Paused, ``import dptrain.run`` (torch, ``torch._dynamo``, the training loop) takes 2.0-2.3 s of
CPU instead of 2.3-2.9 s (median per-round ratio 0.86, 8 alternated rounds), and a fork server's preload 2.1-2.5 s instead of 2.4-2.9 s
(0.81): ``python docs/repro/import_cost.py``, bench_results/import_cost.txt. What the imports leave as cyclic garbage
(8,700 cycles) is collected by the first collection after the pause, or, in a fork server, frozen with the rest
(:mod:`dptrain.launch.frozen`).
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
