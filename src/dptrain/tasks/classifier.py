"""A fast smoke task: classify points drawn from Gaussian clusters with a small MLP.

The data is generated from the seed (no download), the model trains in seconds, and
accuracy tells at a glance whether training works: chance is 1/classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from dptrain.models.mlp import MLPClassifier

__all__ = ["ClassifierTask", "gaussian_clusters"]


def gaussian_clusters(samples: int, features: int, classes: int, noise: float, seed: int,
                      split: int = 0) -> TensorDataset:
    """Points around ``classes`` centers drawn from ``seed``; ``split`` picks an independent
    sample of the same clusters (0 train, 1 validation)."""
    centers = torch.randn(classes, features, generator=torch.Generator().manual_seed(seed)) * 2.0
    generator = torch.Generator().manual_seed(seed * 1_000_003 + split + 1)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    points = centers[labels] + noise * torch.randn(samples, features, generator=generator)
    return TensorDataset(points, labels)


class ClassifierTask:
    name = "classifier"
    tokens_per_sample = 1
    collate_fn = None

    def __init__(self, features: int, classes: int, hidden: int, depth: int, samples: int, noise: float,
                 seed: int, model_kwargs: dict | None = None, factory: Callable[..., nn.Module] | None = None):
        self.train_set = gaussian_clusters(samples, features, classes, noise, seed)
        self.val_set = gaussian_clusters(max(samples // 4, 1), features, classes, noise, seed, split=1)
        self._shape = dict(features=features, classes=classes, hidden=hidden, depth=depth)
        self._model_kwargs = model_kwargs or {}
        self._factory = factory

    def build_model(self) -> nn.Module:
        if self._factory is not None:
            return self._factory(**self._model_kwargs)
        return MLPClassifier(**self._shape)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    @torch.no_grad()
    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        logits = model(x).float()
        return {"loss_sum": F.cross_entropy(logits, y, reduction="sum").item(), "count": float(len(y)),
                "correct": (logits.argmax(-1) == y).sum().item()}
