"""The cyclic garbage collector paused while a process imports torch and dptrain's training code.

Importing torch, ``torch._dynamo`` and the training loop makes hundreds of thousands of objects the collector tracks
(496,919 for the test suite's fork-server list), nearly all alive for the process's life; while they are made, each
full collection walks every one made so far, over and over. Paused, ``import dptrain.run`` (torch, ``torch._dynamo``,
the training loop) takes a seventh less CPU (median per-round ratio 0.86; medians 2.39 against 3.06 s), and a fork
server's preload 0.85 (2.38 against 3.14 s), 8 alternated rounds: ``python docs/repro/import_cost.py``,
bench_results/import_cost.txt. What the imports leave as cyclic garbage (8,693 unreachable objects, by
``gc.collect()``'s count, after the preload) is collected by the first collection after the pause, or, in a fork
server, frozen with the rest (:mod:`dptrain.launch.frozen`).

After the imports, an exec'd worker freezes them (:func:`freeze_imports`) and the ``dptrain`` command freezes what
it holds as it exits (:func:`freeze_at_exit`): neither process's exit then walks torch's objects, which took 0.8-1.0 s
of its exit and 0.8-1.3 s of its CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused", "freeze_imports", "freeze_at_exit"]


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


def freeze_imports() -> None:
    """``gc.freeze()``: every object tracked now leaves the collector's reach for the process's life.

    For a program's entry point, after its imports (``python -m dptrain.run``): torch's and dptrain's half million
    objects are then walked by no later full collection, neither the run's nor those the interpreter makes as it
    exits. An exec'd worker (torchrun's, Slurm's) of a 4-step run took a median 1.14 s from its last line to its
    exit and 3.79 s of CPU in all; frozen, 0.17 s and 2.53 s (median ratios 0.145 and 0.678, 6 alternated rounds:
    ``python docs/repro/exit_cost.py``, bench_results/exit_cost.txt). A worker forked from a fork server has this
    already (:mod:`dptrain.launch.frozen`). What is frozen is never freed: the imports' objects live as long as the
    process anyway, and their cyclic garbage (about 8,700 objects) is kept with them. (Those workers now end
    without the interpreter's teardown, :mod:`dptrain.utils.worker_exit`, whose flush of open files walks only
    what is not frozen.)
    """
    gc.freeze()


def freeze_at_exit() -> None:
    """:func:`freeze_imports` as the interpreter begins to exit (``atexit``; registered once however often called).

    For the ``dptrain`` command, which a test suite may call in its own process, where a freeze while it runs would
    keep whatever the suite holds then for good. Its exit walked and freed every object torch made: the process
    of ``dptrain run --nproc 1`` took a median 1.19 s from its last line to its exit, 0.41 s with this, and its CPU,
    the children it reaped included, went from 3.07 s to 2.26 s (median ratios 0.350 and 0.742, the same study).
    What a collection at exit would have finalized is left unfinalized, as Python allows: it does not promise to
    call ``__del__`` for objects alive when the interpreter exits, and dptrain closes its files explicitly.
    """
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
