"""The end of a live job: replica 0 holds the final state, and the others stay until it has it.

Replica 0 writes the run's outputs (or, in a user's loop, is the one whose weights are
kept), so the job is over when it has committed the last step: it marks :data:`FINAL_KEY`
in the live store. A worker that finishes first does not leave at once: replica 0 may be
away (killed, restarting), and only a peer can heal it. So the others answer rounds, with
nothing to step, until replica 0 has the final state, or has been gone past
``join_timeout_s``. :data:`DONE_KEY` marks a job whose outputs are written: a worker started
after it has nothing to join.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dptrain.live.manager import LiveManager

__all__ = ["FINAL_KEY", "DONE_KEY", "mark_final", "serve_until_final"]

FINISH_POLL_S = 0.1
FINAL_KEY, DONE_KEY = "final/0", "done"  # replica 0 holds the final state; it has written it


def mark_final(manager: LiveManager) -> None:
    """Replica 0 holds the final state: the others need not stay to heal it."""
    manager.store.set(FINAL_KEY, "1")


def serve_until_final(manager: LiveManager, held: Callable[[], dict], held_hash: Callable[[], bytes],
                      load: Callable[[dict], bytes]) -> None:
    """Stay, with nothing to step, until replica 0 has the final state: it marks it at once when it took the last
    step; otherwise (it is away, or restarting) this worker answers rounds, so that it is healed when it joins
    (``held``, ``held_hash``, ``load``: as :meth:`LiveManager.begin` takes them). Leaves once it has, or when it
    has been stale for ``join_timeout_s``."""
    store, settings, t0 = manager.store, manager.settings, time.monotonic()
    finished = lambda: store.check([FINAL_KEY]) or store.check([DONE_KEY])  # noqa: E731
    while not finished() and time.monotonic() - t0 < settings.heartbeat_timeout_s:  # it took the last step with us
        time.sleep(FINISH_POLL_S / 10)
    gone_since = None
    while not finished():
        if manager.liveness.stale(0):
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > settings.join_timeout_s:
                return
        else:
            gone_since = None
        attempt = manager.begin(held, held_hash, load, abandon=finished)
        if attempt is not None:
            manager.end(attempt, False, counted=False)
        time.sleep(FINISH_POLL_S)
