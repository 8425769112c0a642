"""The parameters ZeRO replaced by flat shards, and a check that no optimizer steps them.

An optimizer created before wrapping holds the model's original parameters, which ZeRO
emptied: its step would update nothing, silently. torch's optimizer step pre-hooks are
process-wide, so this registry and its check are too: each replaced parameter is
remembered by a weak reference, and any optimizer's step that finds one raises, naming
the fix (wrap first, then create the optimizer from ``model.parameters()``).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["mark_replaced"]

_REPLACED: dict[int, weakref.ref] = {}
_HOOKED = False


def mark_replaced(param: torch.Tensor) -> None:
    """Remember ``param`` as replaced; the first call installs the optimizer check."""
    global _HOOKED
    _REPLACED[id(param)] = weakref.ref(param)
    if not _HOOKED:
        register_optimizer_step_pre_hook(_check_optimizer)
        _HOOKED = True


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            replaced = _REPLACED.get(id(p))
            if replaced is not None and replaced() is p:
                raise RuntimeError(
                    "this optimizer was created before the model was wrapped with ZeRO: it holds the model's "
                    "original parameters, which ZeRO replaced by flat shards, so its step would update nothing. "
                    "Wrap first, then create the optimizer: model = ZeRO(model, ...); "
                    "optimizer = torch.optim.AdamW(model.parameters(), ...)")
