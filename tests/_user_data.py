"""A user's own datasets, loaded by the tests through data.factory = "_user_data:<name>"."""

import torch
from torch.utils.data import Dataset


class Clusters(Dataset):
    """Gaussian clusters as dict samples {"x": features, "labels": class}: what the loss protocol passes by keyword."""

    def __init__(self, samples: int, features: int, classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(0)) * 3
        self.labels = torch.randint(classes, (samples,), generator=g)
        self.x = centres[self.labels] + torch.randn(samples, features, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.labels[i]}


def stack(samples: list[dict]) -> dict:
    """The user's collate function: a list of dict samples -> one dict of stacked tensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def clusters(samples: int = 512, features: int = 16, classes: int = 8):
    return Clusters(samples, features, classes, 1), Clusters(samples // 4, features, classes, 2), stack


class KeywordMLP(torch.nn.Module):
    """Takes the batch by keyword and returns its logits (the protocol computes the cross-entropy)."""

    def __init__(self, features: int = 16, classes: int = 8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))

    def forward(self, x, labels=None):
        return self.net(x)


def keyword_mlp(**kwargs) -> torch.nn.Module:
    return KeywordMLP(**kwargs)


def not_datasets():
    return [1, 2, 3], [4]
