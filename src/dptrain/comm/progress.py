"""The thread that drives dptrain's own collectives (their handles are :class:`~dptrain.comm.work.Work`).

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
from collections.abc import Callable

import torch
import torch.distributed as dist

from dptrain.comm.wire import Workspace
from dptrain.comm.work import Work  # re-exported: the handle submit() returns

__all__ = ["Work", "ProgressThread", "progress_thread", "stop_progress_threads"]


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

    def stop(self) -> None:
        """End the thread once the collectives submitted before this have run."""
        self._jobs.put(None)

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end (after :meth:`stop`); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            run, work = job
            try:
                run()
            except BaseException as error:  # delivered to the waiter, who re-raises it
                work.mark_done(error)
            else:
                work.mark_done()


_THREADS: dict[int, tuple[object, ProgressThread]] = {}
_THREADS_LOCK = threading.Lock()


def stop_progress_threads(timeout_s: float = 10.0) -> None:
    """Stop every group's progress thread, wait for each to end (up to ``timeout_s`` each), and forget it, and with
    it the registry's hold on its group: for a process that leaves its groups
    (``launch.rendezvous.leave_process_groups``), so that a destroyed group's backend can be freed and the next group
    made in the same process starts a thread of its own.

    The wait makes sure no progress thread is inside a collective of a group being destroyed, nor left running
    when the process ends (:mod:`dptrain.utils.worker_exit`). A thread stuck in a collective whose peer is gone
    is left after the wait."""
    with _THREADS_LOCK:
        entries = list(_THREADS.values())
        _THREADS.clear()
    for _, thread in entries:
        thread.stop()
    for _, thread in entries:
        thread.join(timeout_s)


def progress_thread(group: dist.ProcessGroup) -> ProgressThread:
    """The progress thread of ``group`` (started on first use)."""
    with _THREADS_LOCK:
        entry = _THREADS.get(id(group))
        if entry is None or entry[0] is not group:
            entry = (group, ProgressThread(f"dptrain-comm-{id(group):x}"))
            _THREADS[id(group)] = entry
        return entry[1]
