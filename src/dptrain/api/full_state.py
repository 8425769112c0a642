"""The whole model under any strategy, and the end of training: Accelerate's ``get_state_dict``,
``unwrap_model`` and ``end_training``, for ``prepare()``'s model, an ``Engine`` or a wrapper.

Whatever holds the weights (DDP's replicas, ZeRO's shards, local SGD's and gossip's
drifting replicas, DiLoCo's global weights kept apart from the inner replicas), the user
asks one question and gets one answer:

- :func:`get_state_dict`: the full state dict under the bare model's names, the same on
  every rank. **Every rank calls it**: ZeRO gathers its shards, and the strategies whose
  replicas differ by design average them (DiLoCo returns its global weights), all on a
  copy (the wrapper's :meth:`~dptrain.strategies.protocol.DataParallelWrapper.full_state_dict`).
  Save it on rank 0 only; the call itself is collective, as Accelerate's is under ZeRO-3.
- :func:`set_state_dict`: every rank loads one (bare names, or ``module.``-prefixed).
- :func:`unwrap_model`: the model as you built it (``model.module``).
- :func:`end_training`: after the last step, every rank: the replicas made one model where
  they differ by design (local SGD's last average, DiLoCo's last outer step); after it,
  every rank holds the same weights, the ones ``get_state_dict`` gives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptrain.api.prepared_model import PreparedModel
from dptrain.strategies.protocol import DataParallelWrapper

__all__ = ["get_state_dict", "set_state_dict", "unwrap_model", "end_training"]


def wrapper_of(model: Any) -> DataParallelWrapper:
    """The strategy's wrapper behind ``prepare()``'s model, an ``Engine`` (its ``.model``), or a wrapper itself."""
    inner = model.wrapper if isinstance(model, PreparedModel) else getattr(model, "model", model)
    if not isinstance(inner, DataParallelWrapper):
        raise TypeError(f"expected a model returned by dptrain.prepare(), a dptrain.Engine or a strategy's wrapper, "
                        f"got {type(model).__name__}: for a bare model, its own state_dict() is the whole model")
    return inner


def get_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Collective (every rank): the full model's state dict under the bare model's names, the same on every rank."""
    return wrapper_of(model).full_state_dict()


def set_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Every rank: load a full state dict (bare names, or ``module.``-prefixed as torch's DDP saves)."""
    bare = {k.removeprefix("module."): v for k, v in state.items()}
    wrapper_of(model).load_full_state_dict(bare)


def unwrap_model(model: Any) -> nn.Module:
    """The model as it was built (``.module``); a bare module is returned as it is."""
    if isinstance(model, nn.Module) and not isinstance(model, (PreparedModel, DataParallelWrapper)):
        return getattr(model, "module", model) if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return wrapper_of(model).module


def end_training(model: Any) -> None:
    """Collective, after the last step: close the strategy's open round (``finish()``), so every rank holds the
    model that :func:`get_state_dict` returns. Call it before the final evaluation and before saving."""
    wrapper_of(model).finish()
