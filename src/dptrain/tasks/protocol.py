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

__all__ = ["call_model", "protocol_loss", "protocol_eval_sums", "ProtocolError", "IGNORE"]

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
