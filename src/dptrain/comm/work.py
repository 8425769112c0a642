"""The one handle for asynchronous work in dptrain: ``wait()`` blocks until it is done and returns its result.

Work comes from three places: a backend collective (``torch.distributed.Work``),
a job run by a :class:`~dptrain.comm.progress.ProgressThread` (dptrain's own
algorithms, compressed reductions), or nothing at all (world size 1, an empty
tensor). All three end the same way: local steps that must run after the
communication and in the waiting thread (averaging, decoding, copying a result back
into a non-contiguous tensor), chained with :meth:`Work.then`, run once, on the first
``wait()``. The DDP engine, the collectives, ZeRO and compression share this class;
torch's ``Future`` keeps its place only where users write their own comm hooks.

Timing is a flag, not a wrapper: ``completed_at`` is the ``time.perf_counter()`` at
which the communication ended. A progress-thread job knows it exactly; a backend
collective only with ``timed=True``, which adds a callback on the backend's future (it
runs on the backend's thread, so it is off on the DDP engine's hot path unless spans
are recorded); otherwise ``wait()`` stamps it, an upper bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["Work"]


class Work:
    """Handle of asynchronous work; see the module docstring.

    ``finish`` runs once, on the first ``wait()``, and its return value is the result.
    ``backend_work``: the backend collective to wait for; without it the work is done
    when :meth:`mark_done` is called (by a progress thread, or :meth:`completed`).
    """

    __slots__ = ("_finish", "_backend_work", "_done", "_error", "_result", "_waited", "completed_at")

    def __init__(self, finish: Callable[[], Any] | None = None, backend_work: dist.Work | None = None,
                 timed: bool = False):
        self._finish = finish
        self._backend_work = backend_work
        self._done = threading.Event() if backend_work is None else None
        self._error: BaseException | None = None
        self._result: Any = None
        self._waited = False
        self.completed_at: float | None = None
        if timed and backend_work is not None:
            try:
                backend_work.get_future().add_done_callback(lambda _: self._stamp())
            except RuntimeError:  # some gloo works have no future: wait() stamps them
                pass

    @classmethod
    def completed(cls, finish: Callable[[], Any] | None = None) -> Work:
        """A handle for work with nothing to communicate (world size 1, empty tensor)."""
        work = cls(finish)
        work.mark_done()
        return work

    def then(self, step: Callable[[], Any]) -> Work:
        """Run ``step`` in ``wait()``, after the steps before it; its return value becomes the result. Returns self.

        Chain before anyone waits: a step added after the first ``wait()`` never runs.
        """
        before = self._finish
        self._finish = step if before is None else (lambda: (before(), step())[1])
        return self

    def mark_done(self, error: BaseException | None = None) -> None:
        """The communication ended (with ``error``, re-raised by ``wait()``): for progress threads."""
        self._error = error
        self._stamp()
        self._done.set()

    def _stamp(self) -> None:
        if self.completed_at is None:
            self.completed_at = time.perf_counter()

    def is_completed(self) -> bool:
        if self._backend_work is not None:
            return self._waited or self._backend_work.is_completed()
        return self._done.is_set()

    def wait(self) -> Any:
        if self._waited:
            return self._result
        if self._backend_work is not None:
            self._backend_work.wait()
            self._stamp()
        else:
            self._done.wait()
            if self._error is not None:
                raise self._error
        self._result = self._finish() if self._finish is not None else None
        self._waited = True
        return self._result
