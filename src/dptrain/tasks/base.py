"""What a training task provides the trainer: data, a model, a loss, an evaluation.

A task is the unit the CLI trains (``task.name`` in the config). Its model can be
replaced by the user's own (``task.model = "package.module:factory"``) as long as the
factory's model accepts the task's batches and returns what its loss expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from dptrain.config.factory import load_factory

__all__ = ["Task", "load_factory", "collate", "architecture"]


class Task(Protocol):
    name: str
    tokens_per_sample: int  # for tokens/s: sequence length, or 1 for a classifier
    train_set: Dataset
    val_set: Dataset
    collate_fn: Callable | None  # how samples become a micro-batch; None: torch's default_collate

    def build_model(self) -> nn.Module: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss over the micro-batch."""

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, float]:
        """Sums over the batch (loss_sum, count, ...) that all-reduce into epoch metrics."""


def collate(task: Task) -> Callable:
    """The task's collate function (torch's default_collate when it has none)."""
    return getattr(task, "collate_fn", None) or default_collate


def architecture(task: Task) -> nn.Module:
    """The task's model without pretrained weights (for checks on the meta device and for planning)."""
    build = getattr(task, "build_architecture", None)
    return build() if build is not None else task.build_model()
