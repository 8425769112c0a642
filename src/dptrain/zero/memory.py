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
import time
import warnings
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["storage_bytes", "state_bytes", "live_tensor_bytes", "local_tensor", "zero_formula"]


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


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or for a DTensor (torch's FSDP2 keeps its state in them) its local shard.

    A DTensor is a wrapper without storage of its own; what this rank holds is its local tensor.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def live_tensor_bytes(device: str | None = None, settle_s: float = 0.0) -> int:
    """Bytes of every distinct tensor storage reachable from Python (on ``device`` type, if given).

    DTensors count as their local shards. ``settle_s``: read again every 20 ms for this
    long and return the least reading.

    [Note: a finished collective's tensors] A reading taken right after backward can
    include a full-size gradient that is already garbage. Seen with ZeRO-2 at world 2 in
    about 1 run in 10 of its memory tests beside other tests (pytest -n 2): 1,052,672
    bytes more than the formula, exactly one unit's full-size gradient, gone 0.1 s later.
    The holder was gloo's worker thread, which drops a work (and the tensors in it) only
    after marking it complete, so a moment after ``wait()`` has returned; ZeRO's reductions
    now empty their input's storage themselves ([Note: a finished collective's input] in
    ``zero/reduction.py``, issue 46). Nothing a model holds goes away while we wait, so the
    least reading is what the model holds, whatever else may still hold a tensor briefly.
    """
    least = _live_tensor_bytes(device)
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        least = min(least, _live_tensor_bytes(device))
    return least


def _live_tensor_bytes(device: str | None) -> int:
    gc.collect()
    tensors = []
    with warnings.catch_warnings():  # isinstance() on deprecated module aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if torch.is_tensor(obj) and (device is None or obj.device.type == device):
                    tensors.append(local_tensor(obj))
            except ReferenceError:  # a weak proxy whose referent is gone
                continue
    return storage_bytes(tensors)


def zero_formula(stage: int, numel: int, world_size: int, state_bytes_per_param: int = 8,
                 param_bytes: int = 4, reduce_bytes: int | None = None, master_bytes: int = 4) -> float:
    """dptrain's bytes per rank for ``numel`` parameters held between steps (stage 0: the DDP engine).

    ``param_bytes``: the compute dtype's size (2 for bf16); ``reduce_bytes``: the reduce
    dtype's (default: ``param_bytes``); ``master_bytes``: the shards' (the model's dtype).
    In fp32 (all 4) these are the ZeRO paper's formulas. With a 16-bit compute dtype the
    fp32 master shard is a separate tensor, and so is the fp32 gradient shard the
    optimizer reads, except at stage 1 with an fp32 reduce, where it is a view of the
    full gradient. The paper (K = 12) counts the gradient at 2 bytes instead: its stage 2
    is (2 + 14/N)Ψ where this gives (2 + 16/N)Ψ.
    """
    n, k, p, m = world_size, state_bytes_per_param, param_bytes, master_bytes
    r = p if reduce_bytes is None else reduce_bytes
    master = m if p != m else 0  # the shard is a view of the full buffer when the dtypes agree
    per_param = {0: p + r + k + master,
                 1: p + r + (k + master + (m if r != m else 0)) / n,
                 2: p + (k + master + m) / n,
                 3: (m + m + k) / n}[stage]
    return per_param * numel
