"""The wrapper protocol: what every data-parallel module wrapper offers the layers above it.

A strategy's ``wrap`` (:class:`~dptrain.strategies.registry.Strategy`) returns an
``nn.Module`` that also satisfies :class:`DataParallelWrapper`. The user API (``Engine``,
``prepare()``) and the job runner talk to the wrapper through these members only, never
through its type or its internals, so a new strategy needs no change above its package.
What each member means, and what the three wrappers do:

================================  ==================  =====================  =====================
member                            DDP engine          ZeRO                   gossip (D-PSGD)
================================  ==================  =====================  =====================
``set_requires_gradient_sync``    flag read at        flag read at the end   no-op (gradients are
                                  forward             of backward            never reduced)
``no_sync()``                     the flag, as a context
``last_step_comm``                bucket stats        unit stats and spans   None (not measured
                                                                             as reductions)
``record_comm_spans(on)``         exact completion    no-op (always timed)   no-op
                                  times per bucket
``before_optimizer_step()``       no-op               no-op                  mix with neighbours
================================  ==================  =====================  =====================

The protocol stops at what differs in kind between strategies. Gradient clipping is not in
it: the norm must cover every parameter the optimizer steps, which the wrapper does not
know (``prepare()`` accepts optimizers over parameters outside the model); the step core
(:mod:`dptrain.api.step`) asks the registry whether the parameters are sharded and then
calls the wrapper's own ``clip_grad_norm_`` (ZeRO's sums every rank's shard). Checkpoint
state follows the entry's ``checkpoint_layout`` (:mod:`dptrain.strategies.state`).

The wrappers live below this package and do not import it (the layers point down): they
satisfy the protocol by their shape, and ``tests/test_strategies.py`` checks each one.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from dptrain.comm.step_stats import StepCommStats

__all__ = ["DataParallelWrapper"]


@runtime_checkable
class DataParallelWrapper(Protocol):
    """A module wrapped for data parallelism (DDP engine, ZeRO, gossip); see the module docstring.

    ``module``: the model as the user built it (under ZeRO its parameters live in the shards).
    ``device``: where the model computes.
    """

    module: nn.Module
    device: torch.device

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next backward reduces gradients (False: they add up locally, for accumulation)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """``set_requires_gradient_sync(False)`` for the block, as torch DDP's context manager."""

    @property
    def last_step_comm(self) -> StepCommStats | None:
        """Calls, bytes and spans of the most recent synchronising backward on this rank; None if not measured."""

    def record_comm_spans(self, on: bool) -> None:
        """Record each reduction's exact completion time (a callback per reduction) for traces and overlap."""

    def before_optimizer_step(self) -> None:
        """Collective where the strategy needs one between backward and the optimizer step (gossip's mix)."""
