"""Byte-level language modelling on the standard library's source with a small GPT.

Samples are non-overlapping windows of ``block_size + 1`` bytes: the model sees the
first ``block_size`` and predicts each next byte. Loss is cross-entropy in nats per
byte: ln(256) = 5.55 for a model that knows nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from dptrain.models.gpt import GPT
from dptrain.tasks.corpus import stdlib_corpus

__all__ = ["ByteBlocks", "CharGPTTask"]


class ByteBlocks(Dataset):
    """Item i: bytes [i*B, i*B + B) as input, the same shifted by one as target."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.data[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharGPTTask:
    name = "chargpt"
    collate_fn = None

    def __init__(self, corpus_bytes: int, val_fraction: float, block_size: int, model_kwargs: dict,
                 factory: Callable[..., nn.Module] | None = None):
        corpus = stdlib_corpus(corpus_bytes)
        split = int(len(corpus) * (1 - val_fraction))
        self.train_set = ByteBlocks(corpus[:split], block_size)
        self.val_set = ByteBlocks(corpus[split:], block_size)
        self.tokens_per_sample = block_size
        self._model_kwargs = model_kwargs
        self._factory = factory

    def build_model(self) -> nn.Module:
        if self._factory is not None:
            return self._factory(**self._model_kwargs)
        return GPT(vocab_size=256, **self._model_kwargs)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)  # (B, T, 256)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    @torch.no_grad()
    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="sum")
        return {"loss_sum": loss.item(), "count": float(y.numel())}
