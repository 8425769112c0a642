"""The one mistake a loop ported to ``prepare()`` makes silently: dividing its loss by the accumulation steps.

``optimizer.step()`` divides the window's summed gradients by its micro-step count k, as
Accelerate's ``backward`` divides the loss; a loop that also divides (nanoGPT's does) steps
with gradients k times too small, and nothing fails. This warns of it on the first micro-step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from dptrain.utils.tensors import iter_tensors

__all__ = ["check_loss_not_divided"]


def check_loss_not_divided(out: Any, state: Any) -> None:
    """Warn if the loop divides a loss the model returns by ``grad_accum_steps`` (asked on the first micro-step).

    ``optimizer.step()`` divides the window's summed gradients by its micro-step count k, as
    Accelerate's ``backward`` divides the loss: a loop that also divides its loss by k (nanoGPT's
    does) steps with gradients k times too small, and nothing fails. What can be seen: the
    gradient that reaches a 0-dim output requiring grad (a loss the model returns, as nanoGPT's
    and Hugging Face's models do) is the factor the loop applied to it, exactly 1/k when it
    divided by k. A loss computed outside the model from its outputs carries no such sign (its
    value or the outputs' gradients depend on the loss function), so it is not checked: the
    contract is documented (docs/api.md). A tensor hook on such outputs, on the first micro-step only.
    """
    k = state.grad_accum_steps

    def check(grad: torch.Tensor) -> None:
        factor = float(grad)
        if abs(factor * k - 1.0) < 1e-5:
            warnings.warn(
                f"the gradient reaching the model's loss output (micro-step {state.micro_step} of window "
                f"{state.window}) is {factor:.6g} = 1/{k}: the loop seems to divide its loss by grad_accum_steps={k}. "
                f"prepare() already divides each window's summed gradients by its micro-step count ({k}), so the "
                f"optimizer steps with gradients {k} times too small (1/{k * k} of the mean over the window). Remove "
                "the division: the loss of each micro-step is its micro-batch's mean, as in one process (Accelerate's "
                "contract too: its backward divides the loss itself)", UserWarning, stacklevel=2)

    losses = [t for t in iter_tensors(out) if t.dim() == 0 and t.requires_grad and t.is_floating_point()]
    if len(losses) == 1:  # several scalars: which one is the loss is not known
        losses[0].register_hook(check)
