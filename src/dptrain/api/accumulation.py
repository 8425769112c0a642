"""Where a prepared loop is in its accumulation window: one state per ``prepare()`` call, shared by its wrappers."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AccumulationState"]


@dataclass
class AccumulationState:
    """Where the loop is in the current accumulation window; one per ``prepare()`` call, shared by its wrappers."""

    grad_accum_steps: int
    window: int = 0               # windows opened so far; the current one is number ``window``
    micro_step: int = 0           # micro-steps (training forwards) in the current window
    sync_gradients: bool = True   # the current micro-step closes its window: reduce, step, zero
    end_of_data: bool = False     # a prepared loader is yielding the last batch of its pass

    def begin_micro_step(self) -> bool:
        """Count a training forward; return whether it closes its window."""
        if self.sync_gradients:  # the previous window closed: this micro-step opens the next
            self.window += 1
            self.micro_step = 0
        self.micro_step += 1
        self.sync_gradients = self.micro_step == self.grad_accum_steps or self.end_of_data
        return self.sync_gradients
