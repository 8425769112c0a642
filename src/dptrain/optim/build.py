"""Optimizers for the built-in trainer: decay matrices, not biases and norms (nanoGPT's rule).

Under ZeRO the optimizer sees flat shards; the trainer wraps with ``split_by=decays`` so
that matrices and vectors never share a unit, and each shard's group is its unit's key.
"""

from __future__ import annotations

import torch
from torch import nn

from dptrain.optim import LAMB, LARS, OneBitAdam
from dptrain.optim.onebit_freeze import FreezeRule

__all__ = ["build_optimizer", "decays"]


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether weight decay applies: matrices and embeddings yes, biases and norm gains no."""
    return p.dim() >= 2


def _decays(p: torch.Tensor) -> bool:
    unit = getattr(p, "_zero_unit", None)  # a ZeRO shard: its unit holds one kind (split_by=decays)
    return bool(unit.key) if unit is not None else decays("", p)


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                    momentum: float, freeze_step: int | None = None,
                    freeze_rule: FreezeRule | None = None) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``model``'s parameters; ``freeze_step`` and ``freeze_rule``: when onebit_adam
    freezes v (``model`` is then the DDP engine it registers its comm hook on; see OneBitAdam)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if _decays(p)], "weight_decay": weight_decay},
              {"params": [p for p in params if not _decays(p)], "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "lars":
        return LARS(groups, lr=lr, momentum=momentum, exclude_1d=True)
    if name == "lamb":
        return LAMB(groups, lr=lr, betas=betas, exclude_1d=True)
    if name == "onebit_adam":
        return OneBitAdam(groups, model, lr=lr, betas=betas, freeze_step=freeze_step, freeze_rule=freeze_rule)
    raise ValueError(f"unknown optimizer {name!r}; use adamw, adam, sgd, lars, lamb or onebit_adam")
