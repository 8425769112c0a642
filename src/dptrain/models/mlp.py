"""A multi-layer perceptron classifier: the smallest model worth training in parallel."""

from __future__ import annotations

from torch import nn


class MLPClassifier(nn.Module):
    def __init__(self, features: int = 16, classes: int = 8, hidden: int = 64, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):  # (B, features) -> (B, classes) logits
        return self.net(x)
