"""Heartbeats through the live store: each worker beats, and watches the others' beats.

A thread of each worker adds 1 to ``hb/<replica>`` every ``interval_s`` and reads every
replica's counter. A replica is *fresh* while its counter has changed within ``timeout_s``
of this worker's own monotonic clock: no clock is compared across machines, only whether
a number moved. A worker that is killed, stopped (SIGSTOP: its threads stop with it) or
whose machine is gone stops beating, and every observer calls it stale ``timeout_s`` later.

A worker starts beating when it is ready to take part (its model built), so a worker the
launcher has just restarted does not make the others wait while it imports torch. A counter
this observer has not yet seen move counts as fresh from the moment it first reads it
(optimistic: a quorum waits at most ``timeout_s`` for a replica that is in fact gone).

Each start of a worker is an *incarnation*: ``inc/<replica>`` counts them, and the thread
reads every replica's. A worker restarted under the same id beats again at once, so it
looks fresh; its new incarnation says that the member a round was formed with is gone
(the commit vote then aborts at once instead of waiting for a vote that will not come).

The thread has its own client of the store: the main thread's store calls would otherwise
queue it behind them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Liveness", "beat_key", "incarnation_key"]


def beat_key(replica: int) -> str:
    return f"hb/{replica}"


def incarnation_key(replica: int) -> str:
    return f"inc/{replica}"


class Liveness:
    """This worker's heartbeat thread and its view of every replica's (see the module docstring).

    ``connect()``: a new client of the live store, for the thread. ``replicas``: how many
    workers the job has (ids 0 .. replicas - 1).
    """

    def __init__(self, connect: Callable[[], object], replica: int, replicas: int, interval_s: float,
                 timeout_s: float, incarnation: int = 0):
        self.connect, self.replica, self.replicas = connect, replica, replicas
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._seen: dict[int, tuple[int, float]] = {}  # replica -> (counter, when it last moved)
        self._incarnations: dict[int, int] = {}
        self.incarnation = incarnation  # this worker's, once started (given: taken already, by a shard group's start)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        """Beat from now on (idempotent)."""
        if self._thread is None:
            store = self.connect()
            if not self.incarnation:
                self.incarnation = store.add(incarnation_key(self.replica), 1)
            self._beat(store)  # before returning: this worker is fresh to the others from its first quorum on
            self._thread = threading.Thread(target=self._run, args=(store,), name="dptrain-live-beat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
            self._thread = None

    def fresh(self) -> set[int]:
        """The replicas whose heartbeat moved within ``timeout_s`` (this worker's own included once it beats)."""
        now = time.monotonic()
        with self._lock:
            return {r for r, (_, moved) in self._seen.items() if now - moved <= self.timeout_s}

    def stale(self, replica: int) -> bool:
        """Whether ``replica`` has not beaten for ``timeout_s`` (never seen: not yet judged, so not stale)."""
        with self._lock:
            seen = self._seen.get(replica)
        return seen is not None and time.monotonic() - seen[1] > self.timeout_s

    def incarnation_of(self, replica: int) -> int:
        """``replica``'s incarnation as last read (0: none seen)."""
        with self._lock:
            return self._incarnations.get(replica, 0)

    def _run(self, store) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat(store)
            except Exception as e:  # the store is gone: the main thread's next store call says so
                self.error = e
                return

    def _beat(self, store) -> None:
        store.add(beat_key(self.replica), 1)
        now = time.monotonic()
        counts = [store.add(beat_key(r), 0) for r in range(self.replicas)]
        incarnations = [store.add(incarnation_key(r), 0) for r in range(self.replicas)]
        with self._lock:
            self._incarnations = dict(enumerate(incarnations))
            for r, count in enumerate(counts):
                old = self._seen.get(r)
                if old is None or old[0] != count:
                    self._seen[r] = (count, now)
