"""When a parameter server applies a gradient and when it lets a worker go on.

- ``sync``: a round collects one gradient from every worker, applies their mean, and
  only then answers them all: synchronous SGD, the same updates as all-reduce DDP.
- ``async``: every gradient is applied the moment it arrives and its worker is answered
  at once (Downpour SGD, Dean et al. 2012): no waiting, stale gradients.
- ``ssp``: async, except that a worker more than ``staleness`` clocks (gradients
  pushed) ahead of the slowest live worker is not answered until the slowest catches up
  (stale synchronous parallel, Ho et al. 2013). ``staleness=0`` makes every worker wait
  for the slowest before each step; ``staleness=inf`` is async.
- ``backup``: a round applies the mean of the first ``workers - backups`` gradients
  computed from the current version; the rest arrive late, are dropped, and their
  workers get the new version (Chen et al. 2016, "Revisiting distributed synchronous
  SGD").

Staleness of an applied gradient, in clocks: how many steps ahead of the slowest live
worker its worker was when it read the parameters it computed on, i.e. how many of the
slowest worker's gradients its parameters may lack. SSP bounds it by ``staleness``;
sync and backup always give 0 (a late gradient is dropped, not applied). Delay, in
updates: how many updates the server applied between that read and this gradient's
application (the usual measure in analyses of async SGD).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Consistency", "MODES"]

MODES = ("sync", "async", "ssp", "backup")


@dataclass(frozen=True)
class Consistency:
    mode: str = "sync"
    staleness: float = 0       # ssp: the bound s, in clocks
    backups: int = 0           # backup: gradients per round that are not waited for

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown parameter-server mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.staleness < 0:
            raise ValueError(f"the staleness bound must be >= 0, got {self.staleness}")
        if self.backups < 0:
            raise ValueError(f"the number of backup workers must be >= 0, got {self.backups}")

    def check_lookahead(self, lookahead: bool) -> None:
        """Look-ahead compensates delay; in the round modes every applied gradient is fresh."""
        if lookahead and self.rounds:
            raise ValueError(f"ps.lookahead is for the async and ssp modes; in {self.mode} mode every applied "
                             f"gradient is fresh (delay 0), so there is nothing to look ahead for")

    def check_workers(self, num_workers: int) -> None:
        if self.mode == "backup" and self.backups >= num_workers:
            raise ValueError(f"backups={self.backups} with {num_workers} worker(s): a round needs at least one "
                             f"gradient, so use at most {num_workers - 1} backup(s) or more workers")

    @property
    def rounds(self) -> bool:
        """Whether updates are rounds of averaged gradients (sync, backup) rather than one per arrival."""
        return self.mode in ("sync", "backup")

    @property
    def bound(self) -> float:
        """The clock lead a worker may have over the slowest before it waits."""
        return self.staleness if self.mode == "ssp" else math.inf

    def needed(self, num_workers: int, live: int) -> int:
        """Gradients that complete a round."""
        return live if self.mode == "sync" else min(num_workers - self.backups, live)
