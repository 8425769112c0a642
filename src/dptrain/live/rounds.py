"""A live round's end, as every loop closes it (``dptrain run``'s gates and ``dptrain.Live`` in a user's loop).

After a round's decision (and the optimizer step on commit): replica 0 marks the final state
if the round committed the run's last step (:mod:`~dptrain.live.finish`: the others need not
stay to heal it); the manager moves on to the next round (``advance``: the steps a commit
completes); on a commit that is due for a check, the state's hash is kept for the next round
to compare (:mod:`~dptrain.live.trust`); the worker's live log gets the attempt's line.
"""

from __future__ import annotations

from collections.abc import Callable

from dptrain.live.finish import mark_final
from dptrain.live.log import LiveLog
from dptrain.live.manager import Attempt, LiveManager

__all__ = ["close_round"]


def close_round(manager: LiveManager, log: LiveLog | None, attempt: Attempt, step: int, committed: bool, *,
                last: bool, held_hash: Callable[[], bytes] | None, advance: int = 1, meeting: bool = False) -> None:
    """Close ``attempt``'s round (see the module docstring). ``last``: this worker is replica 0 and ``step`` is the
    run's last; ``held_hash``: the state's hash, where this step is due for a check (None: not due)."""
    if committed and last:
        mark_final(manager)
    recovery = manager.end(attempt, committed, advance=advance)
    digest = held_hash() if committed and held_hash is not None else None
    if digest is not None:
        manager.check = f"{step}:{manager.layout.part}{digest.hex()}"
    if log is not None:
        log.attempt(attempt, step, committed, recovery, manager, digest, meeting=meeting)
