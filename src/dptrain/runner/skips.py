"""A bound on consecutive skipped steps: a run that no longer learns ends with exit 1, and says why.

The engine skips a step whose gradient norm is not finite (a NaN from one bad batch, an fp16
overflow), and the run goes on. That is right for one step; it is wrong for every step: a
learning rate of ``inf`` left every weight NaN, and the run finished with exit 0 and NaN in its
summary. So ``train.max_skipped_steps`` skipped steps in a row end the run, as does a run that ends
on a streak of skips covering half its steps or more.
"""

from __future__ import annotations

from dptrain.api.step import NonFiniteRun

__all__ = ["NonFiniteRun", "SkipBound"]


class SkipBound:
    """Ends a run after ``limit`` consecutive skipped steps (non-finite gradients), instead of finishing it
    with exit 0 and the weights it had: a learning rate too large, data that overflows, a model that blew up.
    The skip count is the same on every rank (the norm is of the reduced gradient), so every rank stops."""

    def __init__(self, limit: int, skipped: int):
        self.limit, self.skipped, self.run = limit, skipped, 0

    def check(self, step: int, skipped: int) -> None:
        self.run, self.step = (self.run + 1 if skipped > self.skipped else 0), step
        self.skipped = skipped
        if self.limit and self.run >= self.limit:
            self._fail()

    def check_end(self, steps: int) -> None:
        """A run shorter than the limit that ends on skipped steps, most of its steps: the same failure."""
        if self.run and self.run >= min(self.limit or steps, max(1, steps // 2)):
            self._fail()

    def _fail(self) -> None:
        raise NonFiniteRun(f"steps {self.step - self.run + 1}-{self.step}: {self.run} steps in a row had non-finite "
                           "gradients and were skipped (the weights stopped changing): lower train.lr, check the "
                           "data, or resume from an earlier checkpoint")
