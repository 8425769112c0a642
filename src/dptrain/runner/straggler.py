"""An injected straggler, for experiments and tests: one rank computes ``factor`` times slower.

Once per step, after its first forward, the rank sleeps ``(factor - 1) x`` its compute
time of the previous step (forward and backward, without the sleep and without any
time spent waiting for other ranks), so a step's compute takes about ``factor`` times
as long. The sleep sits before backward on purpose: under the DDP engine a rank's
gradients start leaving during backward, so a delay after backward would hide behind
the all-reduce instead of holding the other ranks up, as a slow device does. Waiting
is left out of the measure so the delay does not feed on itself: a straggler that
waits for others (after dynamic batching gave it less work, say) would otherwise sleep
longer the next step. A sleep does not use a core, so on a machine with fewer cores
than ranks the others may run faster meanwhile; docs/async.md says where that matters.
"""

from __future__ import annotations

import time

__all__ = ["Straggler"]


class Straggler:
    def __init__(self, factor: float):
        if factor < 1.0:
            raise ValueError(f"a straggler's factor must be >= 1 (how many times slower), got {factor}")
        self.factor = factor
        self.last_compute_s = 0.0
        self.slept_s = 0.0  # in the current step

    def delay(self) -> None:
        """Sleep for this step (call once, after the first forward)."""
        self.slept_s = (self.factor - 1.0) * self.last_compute_s
        if self.slept_s > 0:
            time.sleep(self.slept_s)

    def step_done(self, compute_s: float) -> None:
        """This step's forward and backward time, including the sleep, excluding waits for other ranks."""
        self.last_compute_s = max(0.0, compute_s - self.slept_s)
