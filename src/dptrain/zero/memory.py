"""Bytes of training state, counted from live tensors (not estimated from formulas).

Two counts, used by the tests and the ZeRO benchmark:

- :func:`state_bytes`: a ZeRO model's parameters, gradients and optimizer state by
  category, each storage counted once (a stage 1-2 shard is a view of its unit's full
  buffer, a stage 1 gradient shard a view of the full gradient);
- :func:`live_tensor_bytes`: every tensor the Python garbage collector can see in this
  process, each storage once: whatever a wrapper keeps (bucket buffers included) shows
  up here even if nobody thought to count it.

The ZeRO paper's per-rank formulas for Ψ fp32 parameters trained with Adam (4 bytes
each of parameters and gradients, 8 of optimizer state): DDP 16Ψ, stage 1 (8 + 8/N)Ψ,
stage 2 (4 + 12/N)Ψ, stage 3 16Ψ/N.
"""

from __future__ import annotations

import gc
import warnings
from typing import Iterable

import torch

__all__ = ["storage_bytes", "state_bytes", "live_tensor_bytes", "zero_formula"]


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (storage.data_ptr(), t.device.type, t.device.index)


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (skipping those already in ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        key = _storage_key(t)
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def state_bytes(model, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer"}`` bytes held by a ZeRO model and its optimizer."""
    seen: set = set()
    params = [u.full for u in model.units] + [u.shard for u in model.units] + list(model._frozen)
    grads = [u.full_grad for u in model.units] + [u.shard.grad for u in model.units]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": storage_bytes(params, seen), "gradients": storage_bytes(grads, seen),
            "optimizer": storage_bytes(state, seen)}


def live_tensor_bytes(device: str | None = None) -> int:
    """Bytes of every distinct tensor storage reachable from Python (on ``device`` type, if given)."""
    gc.collect()
    tensors = []
    with warnings.catch_warnings():  # isinstance() on deprecated module aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if torch.is_tensor(obj) and (device is None or obj.device.type == device):
                    tensors.append(obj)
            except ReferenceError:  # a weak proxy whose referent is gone
                continue
    return storage_bytes(tensors)


def zero_formula(stage: int, numel: int, world_size: int, state_bytes_per_param: int = 8,
                 param_bytes: int = 4, grad_bytes: int = 4) -> float:
    """The ZeRO paper's bytes per rank for ``numel`` parameters (stage 0: plain data parallelism)."""
    n, k = world_size, state_bytes_per_param
    p, g = param_bytes, grad_bytes
    per_param = {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
    return per_param * numel
