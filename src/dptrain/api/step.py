"""The optimizer step both user APIs take: average the window, clip, skip a non-finite step, step.

``Engine.step()`` and ``prepare()``'s ``optimizer.step()`` both end a window of ``k``
micro-steps through :class:`OptimizerStep`, in this order:

1. unscale the gradients if a ``GradScaler`` scaled the loss (fp16);
2. **the accumulation rule**, one for both: backward *sums* the micro-steps' gradients (the
   first ``k - 1`` under the strategy's ``no_sync``, the last reduced, which averages over
   ranks), and the step divides the sum by ``k``, the window's micro-step count. Each loss
   being a micro-batch mean, the gradient becomes the mean over the window's global batch.
   ``prepare()`` needs the rule this way round, since ``loss.backward()`` is the user's
   (nanoGPT scales the loss instead); ``Engine.backward(loss, weight)`` turns dynamic
   batching's weight on a micro-batch into a weight relative to this ``1 / k``;
3. clip by the global L2 norm (under a sharding strategy the wrapper's own
   ``clip_grad_norm_``, over every rank's shard), keeping the norm before clipping;
4. a non-finite norm skips the optimizer step. The norm is the same on every rank after the
   reduction, so every rank skips together (gossip's ranks keep their own gradients, and
   decide alone);
5. the wrapper's ``before_optimizer_step()`` (gossip mixes the parameters here, even on a
   skipped step: it is a collective with the neighbours);
6. ``optimizer.step()`` (through the scaler under fp16), then ``zero_grad`` if asked;
7. the wrapper's ``after_optimizer_step()``, after every step, skipped ones included, so that
   every rank counts the same steps (a strategy that averages the replicas every few steps
   does it here).

The divisions cost one pass over the gradients per optimizer step and none when ``k`` is 1;
nothing is added per micro-step or per gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptrain.launch.heartbeat import mark_progress

__all__ = ["OptimizerStep", "StepOutcome", "NonFiniteRun", "clip_by_global_norm", "average_window"]


class NonFiniteRun(RuntimeError):
    """Training cannot go on for non-finite gradients: every step of a window was skipped
    (``dptrain.runner.skips``), or the optimizer had already applied them inside backward."""


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float   # global L2 norm of the window's mean gradient, before clipping
    skipped: bool      # the norm was not finite: the optimizer did not step
    result: Any = None  # what optimizer.step(closure) returned


class OptimizerStep:
    """The step at the end of an accumulation window (see the module docstring), with its counts.

    ``wrapper``: the strategy's module (None for an optimizer prepared without a model);
    ``sharded``: the registry's ``shards_parameters`` for it, so the norm is the wrapper's
    over every rank's shard. ``steps`` counts the windows closed, skipped ones included (the
    schedule and the data move on); ``skipped_steps`` those skipped.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, wrapper: nn.Module | None = None, *,
                 grad_clip: float = 0.0, sharded: bool = False, scaler: Any = None):
        self.optimizer, self.wrapper, self.grad_clip = optimizer, wrapper, grad_clip
        self.sharded, self.scaler = sharded, scaler
        self.in_backward = False  # the optimizer steps inside backward (the DDP engine's optimizer_in_backward)
        self.steps = 0
        self.skipped_steps = 0

    def __call__(self, micro_steps: int, closure: Callable[[], float] | None = None,
                 zero_grad: bool = True) -> StepOutcome:
        """Close a window of ``micro_steps`` summed micro-steps; see the module docstring."""
        mark_progress(self.steps + 1)  # this process's heartbeat, if any (dptrain launch --timeout)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = self._params()
        average_window(params, micro_steps)
        norm = clip_by_global_norm(params, self.grad_clip, self.wrapper if self.sharded else None)
        skipped = not math.isfinite(norm)
        if skipped and self.in_backward:
            raise NonFiniteRun(f"step {self.steps + 1}: the gradients were not finite (norm {norm}) and the optimizer "
                               "had already applied them inside backward (optimizer_in_backward), so the step could "
                               "not be skipped: lower the learning rate, or turn optimizer_in_backward off so that "
                               "such steps are skipped")
        if self.wrapper is not None:
            self.wrapper.before_optimizer_step()
        result = self._step(skipped, closure)
        if zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.skipped_steps += skipped
        if self.wrapper is not None:  # every step, skipped ones too: the ranks' counts never part
            self.wrapper.after_optimizer_step()
        return StepOutcome(norm, skipped, result)

    def _params(self) -> list[torch.Tensor]:
        """The parameters this step averages and clips: the optimizer's, and every shard when sharded.

        Not the whole model's: ``prepare()`` may split a replicated model between optimizers,
        each of which divides only its own gradients.
        """
        params = {id(p): p for g in self.optimizer.param_groups for p in g["params"]}
        if self.sharded:
            params.update((id(p), p) for p in self.wrapper.parameters())
        return [p for p in params.values() if p.grad is not None]

    def _step(self, skipped: bool, closure: Callable[[], float] | None) -> Any:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by itself on inf/nan
            self.scaler.update()
            return None
        if skipped:
            return None
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()


@torch.no_grad()
def average_window(params: list[torch.Tensor], micro_steps: int) -> None:
    """The accumulation rule: divide the summed gradients of a window by its micro-step count."""
    if micro_steps > 1:
        for p in params:
            p.grad.div_(micro_steps)


def clip_by_global_norm(params: list[torch.Tensor], grad_clip: float, sharded: nn.Module | None = None) -> float:
    """The gradients' global L2 norm before clipping them to ``grad_clip`` (0: the norm only).

    With ``sharded`` (a wrapper holding shards, e.g. ZeRO) the norm is its ``clip_grad_norm_``'s,
    over every rank's shard and the same on every rank; otherwise over ``params``' gradients,
    which the all-reduce made the same on every rank. A norm that is not finite is for the
    caller to skip the step on.
    """
    max_norm = grad_clip if grad_clip > 0 else math.inf
    if sharded is not None:
        return float(sharded.clip_grad_norm_(max_norm))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
