"""The optimizer step of each bucket as soon as its all-reduce completes, inside backward.

Algorithm: at the end of backward the reducer waits for the buckets' all-reduces in launch
order (the last layers' first). Once bucket *k*'s averaged gradients are written to
``.grad``, its parameters are stepped at once, while buckets *k+1..n* are still being
reduced; the update of all but the last bucket then overlaps communication instead of
following it. torch applies the same idea with its private ``_register_fused_optim``
(a functional optimizer run from a comm hook, the "optimizer in backward" of Li et al.'s
DDP and of torch's ``_apply_optimizer_in_backward``); here the user's own optimizer
object steps, one bucket's parameters at a time, so its state, param groups, learning-rate
scheduler and ``state_dict`` stay the ones the user built.

Exact for an optimizer whose update of a parameter reads only that parameter's gradient
and state (SGD, Adam, AdamW, RMSprop, Adagrad, dptrain's LARS and LAMB, whose trust ratio
is per parameter): stepping the parameters in groups gives the same bits as one step
(tests/test_ddp_schedule.py compares against torch's DDP after every step). It is wrong
for anything that needs every gradient first: a clip by the global norm, a loss scaler
that unscales and checks all gradients (``GradScaler``), an optimizer that couples
parameters. ``dptrain run`` refuses those; from Python, do not combine them.

After registration, the optimizer's ``step()`` is a no-op for the parameters the last
synced backward already stepped (a training loop written for torch runs unchanged: the
``opt.step()`` after ``loss.backward()`` updates nothing twice); parameters of the
optimizer that DDP does not reduce (frozen when wrapped, or never registered) are stepped
there as usual. A micro-step under ``no_sync`` steps nothing: the update happens in the
synced backward that ends the accumulation window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["BucketOptimizer"]


class BucketOptimizer:
    """Steps ``optimizer`` one bucket's parameters at a time, called by the reducer."""

    def __init__(self, optimizer: torch.optim.Optimizer, reduced: Iterable[torch.nn.Parameter]):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer_in_backward needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if getattr(optimizer, "communicates_in_step", False):
            raise TypeError(f"optimizer_in_backward steps one bucket's parameters at a time; "
                            f"{type(optimizer).__name__} communicates across ranks in its own step (all parameters at "
                            "once), so it cannot: leave optimizer_in_backward off")
        if hasattr(optimizer, "_dptrain_in_backward"):
            raise RuntimeError("this optimizer already steps in backward (optimizer_in_backward was called twice)")
        self.optimizer = optimizer
        self._step: Callable[..., Any] = optimizer.step  # the step as it is now (a scheduler's wrapper included)
        reduced_ids = {id(p) for p in reduced}
        self._groups = [list(g["params"]) for g in optimizer.param_groups]
        # the optimizer's parameters DDP does not reduce: stepped by opt.step() as usual
        self._others = [[p for p in params if id(p) not in reduced_ids] for params in self._groups]
        self._group_of = {id(p): g for g, params in enumerate(self._groups) for p in params}
        self.stepped = False  # set by a synced backward, cleared by the next opt.step()
        optimizer._dptrain_in_backward = self  # marks it; opt.step is replaced below

        def step(closure: Callable[[], Any] | None = None) -> Any:
            return self._user_step(closure)

        # A learning-rate scheduler wraps opt.step and warns if it finds the wrapper replaced; this one calls
        # that wrapper for every real step, so the scheduler's bookkeeping holds: say so with its mark.
        if getattr(self._step, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = step  # type: ignore[method-assign]

    def step_bucket(self, params: list[torch.nn.Parameter]) -> None:
        """Step ``params`` (one bucket's, their averaged gradients just written) with the user's optimizer."""
        subset: list[list[torch.nn.Parameter]] = [[] for _ in self._groups]
        for p in params:
            g = self._group_of.get(id(p))
            if g is not None:
                subset[g].append(p)
        self._step_only(subset)
        self.stepped = True

    def _step_only(self, subset: list[list[torch.nn.Parameter]]) -> None:
        groups = self.optimizer.param_groups
        try:
            for group, params in zip(groups, subset, strict=True):
                group["params"] = params
            with torch.no_grad():
                self._step()
        finally:
            for group, params in zip(groups, self._groups, strict=True):
                group["params"] = params

    def _user_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``opt.step()``: the whole step where backward did not step (no synced backward since the last call),
        else only the parameters DDP does not reduce."""
        if closure is not None:
            raise RuntimeError("optimizer_in_backward: step(closure) cannot run: the step already ran in "
                               "backward, bucket by bucket (LBFGS-style closures need the whole gradient)")
        if not self.stepped:
            return self._step()
        self.stepped = False
        if any(self._others):
            self._step_only(self._others)
        return None
