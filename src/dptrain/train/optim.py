"""Optimizers for the built-in trainer: decay matrices, not biases and norms (nanoGPT's rule)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["build_optimizer"]


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                    momentum: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    raise ValueError(f"unknown optimizer {name!r}; use adamw, adam or sgd")
