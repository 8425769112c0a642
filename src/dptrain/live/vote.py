"""The commit vote: a step is applied by every member of its round or by none.

torchft's ``should_commit``. After the gradients' all-reduce each member writes its vote
under ``q/<round>/v/<index>`` (1: its collectives completed and its gradients are finite
enough to step; 0: an error). The decision is one key, ``q/<round>/decision``, set once from
empty by ``compare_set``: ``commit`` by the member that sees every vote and all of them 1,
``abort`` by one that sees a 0, a member gone (stale, or started again: a new incarnation,
:mod:`~dptrain.live.liveness`), or ``timeout_s`` pass. Whoever sets it, every member reads the same value, so a member that dies
after voting 1 cannot leave some survivors stepped and others not: either every vote was in
and the survivors all commit, or the decision is abort for all of them.

A member that finds its all-reduce failed while another's completed (a worker dies in the
middle of a ring) votes 0, and the round aborts for everyone; no member ever holds weights
that another member of its round does not.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dptrain.live.liveness import Liveness
from dptrain.live.quorum import Member

__all__ = ["commit_vote"]

POLL_S = 0.001


def commit_vote(store, round_: int, index: int, members: tuple[Member, ...], ok: bool, liveness: Liveness,
                timeout_s: float, progress: Callable[[], None] = lambda: None) -> bool:
    """This member's vote in round ``round_`` (its position ``index`` among ``members``); True: commit."""
    prefix = f"q/{round_}"
    decision = f"{prefix}/decision"
    store.set(f"{prefix}/v/{index}", "1" if ok else "0")
    keys = [f"{prefix}/v/{i}" for i in range(len(members))]
    t0 = time.monotonic()
    while True:
        if store.check([decision]):
            return store.get(decision) == b"commit"
        if store.check(keys):
            verdict = "commit" if all(v == b"1" for v in store.multi_get(keys)) else "abort"
            return store.compare_set(decision, "", verdict) == b"commit"
        gone = any(liveness.stale(m.replica) or 0 < m.incarnation < liveness.incarnation_of(m.replica)
                   for m in members)
        if gone or not ok or time.monotonic() - t0 > timeout_s:
            return store.compare_set(decision, "", "abort") == b"commit"
        progress()
        time.sleep(POLL_S)
