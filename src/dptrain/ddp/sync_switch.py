"""Turning gradient synchronisation off for gradient accumulation (``no_sync``).

Accumulating k micro-batches needs only one reduction: the k-1 backward passes before
the last one can skip communication and let gradients add up locally, and the last
synced backward reduces the sum. Every data-parallel wrapper in dptrain offers the same
switch, as a context manager (torch DDP's ``no_sync()``) and as a named method (FSDP's
``set_requires_gradient_sync``). The flag is read at forward time, as in torch: a
forward run inside ``no_sync()`` makes its backward skip communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["GradSyncSwitch"]


class GradSyncSwitch:
    require_backward_grad_sync: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication inside the block; gradients accumulate locally.

        The first synced backward after it reduces the accumulated sum: k micro-steps
        under ``no_sync`` plus one outside equal one step on a k+1 times bigger batch.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """The switch ``no_sync()`` flips, for loops that prefer a call to a context."""
        self.require_backward_grad_sync = requires_gradient_sync
