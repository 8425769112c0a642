"""How a worker process ends: the interpreter's exit short of its teardown, then ``os._exit``, as a multiprocessing
child ends.

A worker's last objects hold gloo's C++ threads (a process group's backend, its transport)
and torch's C++ state. Torn down by the interpreter's finalization and then the C++ static
destructors, they can race with it, and a C++ thread that ends badly there is
``std::terminate`` ("terminate called without an active exception", SIGABRT) after a run
that had finished: torchrun then reports the job failed. A script's worker met it
([Note: how a worker ends] in :mod:`dptrain.launch.script`); so did ``python -m
dptrain.run`` once its exit stopped walking the objects its imports made
(:mod:`dptrain.utils.collector`) and so came about a second sooner: 7 of 33 torchrun jobs of
4 ranks with the bf16 codec, none of 6 with the imports not frozen, none of 10 ending here
(with dptrain's progress threads joined too; ``docs/notes.md``,
``bench_results/worker_exit_abort.txt``). What a
worker must do at its end is done first (:func:`finish_interpreter`): its non-daemon
threads joined, its atexit handlers run (logging's flush, trackers' finish), every file
it left open flushed; then the process ends without the teardown.

Ending at once has one more consequence: where rank 0's process serves the job's store (torchrun's agents
not sharing theirs, as under ``dptrain cluster``), the store ends with it, so a worker that still uses the
store after its last collective must have rank 0 wait for it ([Note: rank 0 leaves last] in
:mod:`dptrain.tune.probe_runs`, the one that does).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading
from typing import NoReturn

__all__ = ["finish_interpreter", "exit_worker"]


def finish_interpreter() -> None:
    """The interpreter's exit, short of tearing its objects down."""
    for thread in threading.enumerate():  # as the interpreter waits for non-daemon threads
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the handlers registered (logging's flush, trackers' finish)
    for obj in gc.get_objects():  # what a file's finalizer would do at teardown
        if issubclass(type(obj), io.IOBase):  # the type, not the object: touching torch's deprecated aliases warns
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_worker(code: int) -> NoReturn:
    """End this worker with ``code``: :func:`finish_interpreter`, then ``os._exit``."""
    finish_interpreter()
    os._exit(code)
