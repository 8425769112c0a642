"""Imported last by a fork server (:mod:`dptrain.launch.workers`): what it preloaded leaves the collector's reach.

The fork server imports torch, dptrain's training loop and, for a Hugging Face model, transformers: about 377,000
objects the garbage collector tracks (the suite's preload list, imported with the collector running:
bench_results/fork_server_freeze.txt; about 497,000 now that it imports paused, its import garbage and the objects a
collection would have stopped tracking included: bench_results/import_cost.txt), all alive for the server's life. Every forked
worker inherited them, and every full collection it made walked them all: 0.19-0.20 s of CPU for a ``gc.collect()``,
which a run makes as it ends (:func:`dptrain.launch.rendezvous.leave_process_groups`), and 0.10 s for the
``gc.get_objects()`` with which :class:`dptrain.runner.tensor_peak.TensorPeak` finds the tensors alive at its start;
after ``gc.freeze()``, nothing for either (``docs/testing.md``). ``gc.freeze()`` moves every object tracked now into
a generation the collector never walks, as CPython advises for a process that forks without ``exec``: it also keeps
the children's collections from writing into the pages they share with the server. A worker's own objects are
collected as before; the server's are never freed, which they would not have been anyway. Nothing the server
imported holds a tensor a run counts (it computes nothing), so what the workers measure is unchanged.

The server imported with the collector paused (:mod:`dptrain.launch.paused`, imported first): this starts it again
after the freeze, so every worker forked from the server collects as a fresh interpreter does. The cyclic garbage
the imports left (8,693 unreachable objects, by ``gc.collect()``'s count) is frozen with the rest rather than
collected first: a collection would walk everything once more (0.26 s of CPU) and leave the server's resident set
where it is (313.7 MiB either way, the suite's preload list), since the freed memory stays with Python's allocator
(``python docs/repro/import_cost.py``, bench_results/import_cost.txt).
"""

from __future__ import annotations

import gc

from dptrain.utils.collector import freeze_imports

freeze_imports()
gc.enable()
