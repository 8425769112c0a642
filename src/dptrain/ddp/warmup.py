"""A synchronous warm-up on the DDP engine, for a wrapper whose replicas then step alone (local SGD, DiLoCo).

Post-local SGD (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", 2020) and DiLoCo
(Douillard et al., 2023) may start with ``warmup_steps`` synchronous steps: the DDP engine
all-reduces every step's gradients, so the replicas stay equal while the loss falls fastest;
after them, each replica's gradients stay its own. :class:`SyncWarmup` is that switch, shared
by both wrappers: a forward arms the engine's reduction only in the warm-up and outside the
caller's ``no_sync`` (accumulation), and live recovery gives the engine its round's comm hook
(``register_comm_hook``). The wrapper holds ``ddp`` (its engine; None without a warm-up, where
the wrapper runs the module itself), ``options.warmup_steps`` and ``steps`` (optimizer steps
taken).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dptrain.comm.step_stats import StepCommStats

__all__ = ["SyncWarmup"]


class SyncWarmup:
    """The warm-up's switch (see the module docstring); a mixin of an ``nn.Module`` wrapper."""

    _user_sync = True  # what the caller asked (no_sync for accumulation)
    _synced = False    # whether the latest forward armed a gradient reduction

    @property
    def warmup_steps(self) -> int:
        """Steps at the start taken as the DDP engine takes them, the gradients all-reduced (the meeting protocol)."""
        return self.options.warmup_steps

    @property
    def in_warmup(self) -> bool:
        return self.steps < self.options.warmup_steps

    def _warmup_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The engine's forward, its reduction armed in the warm-up only."""
        self._synced = self._user_sync and self.in_warmup
        self.ddp.set_requires_gradient_sync(self._synced)
        return self.ddp(*inputs, **kwargs)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """The warm-up's comm hook (live recovery's round hook), on its DDP engine."""
        if self.ddp is None or not self.options.warmup_steps:
            raise RuntimeError("register_comm_hook: no warm-up (warmup_steps = 0), so no step all-reduces gradients")
        self.ddp.register_comm_hook(state, hook)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """In the warm-up, whether the next backward all-reduces (accumulation); after it, never."""
        self._user_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        before = self._user_sync
        self._user_sync = False
        try:
            yield
        finally:
            self._user_sync = before

    @property
    def last_step_comm(self) -> StepCommStats | None:
        """The DDP engine's buckets for a warm-up step; None after it (the meetings' bytes are in step_metrics())."""
        return self.ddp.last_step_comm if self.ddp is not None and self._synced else None
