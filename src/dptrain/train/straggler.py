"""An injected straggler, for experiments and tests: one rank computes ``factor`` times slower.

After each forward the rank sleeps ``(factor - 1) x (this forward + its previous
backward)``, so its compute per micro-step takes about ``factor`` times as long. The
sleep sits before backward on purpose: under the DDP engine a rank's gradients start
leaving during backward, so a delay after backward would hide behind the all-reduce
instead of holding the other ranks up, as a slow device does. A sleep does not use a
core, so on a machine with fewer cores than ranks the others may run faster meanwhile;
the study in docs/async.md says where that matters.
"""

from __future__ import annotations

import time

__all__ = ["Straggler"]


class Straggler:
    def __init__(self, factor: float):
        if factor < 1.0:
            raise ValueError(f"a straggler's factor must be >= 1 (how many times slower), got {factor}")
        self.factor = factor
        self.last_backward_s = 0.0
        self.slept_s = 0.0  # in total, for the run's report

    def after_forward(self, forward_s: float) -> None:
        delay = (self.factor - 1.0) * (forward_s + self.last_backward_s)
        if delay > 0:
            time.sleep(delay)
            self.slept_s += delay

    def after_backward(self, backward_s: float) -> None:
        self.last_backward_s = backward_s
