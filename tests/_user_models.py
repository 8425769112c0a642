"""A user's own model, loaded by the CLI tests through task.model = "_user_models:factory"."""

from torch import nn


def wide_mlp(features: int = 16, classes: int = 8, width: int = 24) -> nn.Module:
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, classes))


def broken(**kwargs) -> nn.Module:
    raise RuntimeError("no weights in this factory")


class _DataDependent(nn.Module):
    """A forward whose control flow reads a value: it cannot be traced without data."""

    def __init__(self, features: int = 16, classes: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(features, classes), nn.Linear(features, classes)

    def forward(self, x):
        return self.a(x) if x.sum().item() > 0 else self.b(x)


def data_dependent(**kwargs) -> nn.Module:
    return _DataDependent(**kwargs)


def with_buffers(features: int = 16, classes: int = 8, width: int = 24) -> nn.Module:
    """The conformance matrix's plain model: a BatchNorm between two layers (running statistics as buffers)."""
    return nn.Sequential(nn.Linear(features, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, classes))
