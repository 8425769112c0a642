"""Handles for asynchronous collectives, and the thread that drives dptrain's own.

A backend collective progresses inside the backend; dptrain's algorithms are Python
loops of point-to-point rounds, so something must run them while the caller computes
(the DDP engine launches a bucket's all-reduce and goes on with backward). Each process
group gets one :class:`ProgressThread`, which runs the group's collectives one after
another in the order they were called.

[Note: one progress thread per group, in call order]
Messages between two ranks match in the order they are posted. Every rank calls the
group's collectives in the same order, and a single FIFO thread per group posts their
rounds in that order, so no two collectives' messages can cross, without tags or
sequence numbers. A synchronous call is a submit + wait on the same thread, so it too
stays behind the asynchronous calls made before it. The thread uses only
point-to-point operations: collectives of the backend (the agreement check of
:mod:`dptrain.comm.collectives`, the DDP engine's own all-reduces) stay on the caller's
thread, where their order is the program's, and gloo keeps the two kinds in separate
message slots.

The registry of threads is the one piece of module state in :mod:`dptrain.comm`: a
thread belongs to its group as gloo's own worker threads do.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from dptrain.comm.wire import Workspace

__all__ = ["Work", "ProgressThread", "progress_thread"]


class Work:
    """Handle of a collective: ``wait()`` blocks until it is done and returns its result tensor.

    ``finish`` runs once, on the first ``wait()`` in the waiting thread (averaging,
    copying a result back into a non-contiguous tensor). ``completed_at`` is the
    ``time.perf_counter()`` at which the communication ended (None while running).
    """

    def __init__(self, finish: Callable[[], torch.Tensor], backend_work: dist.Work | None = None):
        self._finish = finish
        self._backend_work = backend_work
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: torch.Tensor | None = None
        self.completed_at: float | None = None
        if backend_work is not None:  # else the progress thread marks it done
            try:
                backend_work.get_future().add_done_callback(lambda _: self._mark_done())
            except RuntimeError:  # some gloo works have no future: marked done by wait()
                pass

    def _mark_done(self, error: BaseException | None = None) -> None:
        self._error = error
        self.completed_at = time.perf_counter()
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        if self._backend_work is not None:
            self._backend_work.wait()
            if not self._done.is_set():
                self._mark_done()
        self._done.wait()
        if self._error is not None:
            raise self._error
        self._result = self._finish()
        return self._result

    @classmethod
    def completed(cls, finish: Callable[[], torch.Tensor]) -> "Work":
        """A handle for a collective with nothing to communicate (world size 1, empty tensor)."""
        work = cls(finish)
        work._mark_done()
        return work


class ProgressThread:
    """Runs one group's collectives, one after another, on a daemon thread."""

    def __init__(self, name: str):
        self.workspace = Workspace()  # scratch reused by this thread's collectives
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], None], finish: Callable[[], torch.Tensor]) -> Work:
        work = Work(finish)
        self._jobs.put((run, work))
        return work

    def _loop(self) -> None:
        while True:
            run, work = self._jobs.get()
            try:
                run()
            except BaseException as error:  # delivered to the waiter, who re-raises it
                work._mark_done(error)
            else:
                work._mark_done()


_THREADS: dict[int, tuple[object, ProgressThread]] = {}
_THREADS_LOCK = threading.Lock()


def progress_thread(group: dist.ProcessGroup) -> ProgressThread:
    """The progress thread of ``group`` (started on first use)."""
    with _THREADS_LOCK:
        entry = _THREADS.get(id(group))
        if entry is None or entry[0] is not group:
            entry = (group, ProgressThread(f"dptrain-comm-{id(group):x}"))
            _THREADS[id(group)] = entry
        return entry[1]
