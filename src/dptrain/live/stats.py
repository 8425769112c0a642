"""What live recovery lost and spent, counted by each worker: attempts, commits, quorum sizes, recoveries, heals."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["LiveStats"]


@dataclass
class LiveStats:
    """This worker's counts since it started (a restarted worker starts again from zero; ``logs/live<r>.jsonl``
    keeps every attempt of every worker for the run's totals).

    ``recoveries``: seconds from the start of the first failed attempt after a commit (its round's
    forming) to the next commit: a failure's cost in wall time, as the survivors saw it.
    """

    attempted: int = 0
    committed: int = 0
    aborted: int = 0
    sizes: Counter = field(default_factory=Counter)  # round size -> steps committed at that size
    recoveries: list[float] = field(default_factory=list)
    heal_bytes_sent: int = 0
    heal_bytes_received: int = 0
    heal_s: float = 0.0
    _failed_at: float | None = None

    def attempt(self, committed: bool, size: int, began: float) -> float | None:
        """Count one attempt (``began``: its ``time.monotonic()`` at the start of its round); the recovery time it
        ends, if it is the first commit after a failure: from the start of the failed attempt."""
        self.attempted += 1
        now = time.monotonic()
        if not committed:
            self.aborted += 1
            if self._failed_at is None:
                self._failed_at = began
            return None
        self.committed += 1
        self.sizes[size] += 1
        if self._failed_at is None:
            return None
        took, self._failed_at = now - self._failed_at, None
        self.recoveries.append(took)
        return took

    def record(self, size: int) -> dict[str, float]:
        """Fields for a metrics record."""
        return {"live_quorum": size, "live_attempted": self.attempted, "live_committed": self.committed,
                "live_aborted": self.aborted, "live_heal_bytes": self.heal_bytes_sent + self.heal_bytes_received}
