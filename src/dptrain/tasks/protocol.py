"""The loss protocol: how ``dptrain run`` gets a loss out of any model and any batch.

The model is called on the batch:

- a tuple or list ``(inputs..., targets)``: ``model(*inputs)`` (the usual ``(x, y)``);
- a dict: ``model(**batch)`` (Hugging Face style; ``batch["labels"]`` are the targets);
- anything else: ``model(batch)``, with no targets.

What it returns is read in this order:

1. a scalar tensor: the loss itself;
2. an object with a ``.loss`` that is not None (what ``transformers`` models return when
   given ``labels``): that loss;
3. logits, the tensor itself or an object's ``.logits``: cross-entropy against the targets,
   position by position (last dimension = classes; target -100 is ignored, as in
   ``torch.nn.functional.cross_entropy`` and ``transformers``). Token data gives targets
   already shifted by one, so a causal language model's logits line up with them.

Evaluation reads the output in the same order: a loss the model computed, weighted by
the batch's sample count (``val_loss``); else from logits the summed cross-entropy, the
number of targets and how many the argmax got right (``val_loss``, ``val_accuracy``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["call_model", "protocol_loss", "protocol_eval_sums", "check_classes", "ProtocolError", "IGNORE"]

IGNORE = -100


class ProtocolError(TypeError):
    """A model output or batch the loss protocol cannot read; says what it got and what it takes."""


def call_model(model: nn.Module, batch: Any) -> tuple[Any, torch.Tensor | None, int]:
    """(the model's output, the targets or None, the batch's sample count)."""
    if isinstance(batch, (tuple, list)):
        if len(batch) < 2:
            raise ProtocolError(f"a tuple batch is (inputs..., targets); this one has {len(batch)} element(s)")
        *inputs, targets = batch
        return model(*inputs), targets, len(inputs[0])
    if isinstance(batch, dict):
        first = next(iter(batch.values()))
        return model(**batch), batch.get("labels"), len(first)
    return model(batch), None, len(batch)


def _logits(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    return logits


def _given_loss(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor | None, reduction: str) -> torch.Tensor:
    if targets is None:
        raise ProtocolError(f"the model returned logits {tuple(logits.shape)} and the batch has no targets: give "
                            "batches as (inputs, targets) or a dict with 'labels', or return the loss")
    if logits.shape[:-1] != targets.shape:
        raise ProtocolError(f"logits {tuple(logits.shape)} do not line up with targets {tuple(targets.shape)}: the "
                            "logits' last dimension is the classes, the rest must match the targets position by "
                            "position (shift them yourself for next-token prediction)")
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE,
                           reduction=reduction)


def _read(output: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the loss the model computed, or None; else its logits), or a ProtocolError when it gave neither."""
    loss = _given_loss(output)
    if loss is not None:
        return loss, None
    logits = _logits(output)
    if logits is None:
        raise ProtocolError(f"the model returned {type(output).__name__}, which is not a loss, logits, or an object "
                            "with .loss or .logits (docs/your-data.md: what a model may return)")
    return None, logits


def protocol_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean loss of ``batch``."""
    output, targets, _ = call_model(model, batch)
    loss, logits = _read(output)
    return loss if loss is not None else _cross_entropy(logits, targets, "mean")


@torch.no_grad()
def protocol_eval_sums(model: nn.Module, batch: Any) -> dict[str, float]:
    """Sums over ``batch`` that add up over batches and ranks (``val_metrics`` divides them)."""
    output, targets, samples = call_model(model, batch)
    loss, logits = _read(output)  # as in training: a model that computes its own loss is taken at its word
    if loss is not None:
        return {"loss_sum": float(loss) * samples, "count": float(samples)}
    loss_sum = _cross_entropy(logits, targets, "sum")
    kept = targets != IGNORE
    return {"loss_sum": loss_sum.item(), "count": float(kept.sum()),
            "correct": float(((logits.argmax(-1) == targets) & kept).sum())}


def check_classes(output: Any, batch: Any) -> None:
    """Raise a ProtocolError when ``output``'s logits have fewer classes than ``batch``'s targets need.

    Cross-entropy indexes the logits' last dimension by the target, so a target at or
    beyond it fails only when the loss runs on data (a device-side assert on CUDA). The
    targets are read as :func:`call_model` reads them (a tuple's last element, a dict's
    ``labels``); ``output`` may hold fake tensors (only its shape is read), ``batch`` must
    hold real ones. A model that computes its own loss, or a batch without integer
    targets, is not checked.
    """
    targets = batch[-1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else \
        batch.get("labels") if isinstance(batch, dict) else None
    if _given_loss(output) is not None or not torch.is_tensor(targets) or targets.is_floating_point():
        return
    logits = _logits(output)
    kept = targets[targets != IGNORE]
    if not torch.is_tensor(logits) or logits.dim() == 0 or kept.numel() == 0:
        return
    classes, largest = logits.size(-1), int(kept.max())
    if largest >= classes:
        raise ProtocolError(f"the model's logits have {classes} classes (their last dimension) and a batch's "
                            f"targets go up to {largest}: the model needs at least {largest + 1} outputs (the "
                            "vocabulary size, or the number of classes)")
