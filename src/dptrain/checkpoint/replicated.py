"""The replicated layout: ``model.pt`` and ``optimizer.pt``, what every rank of a replicated strategy holds, written by
rank 0 with ``torch.save`` (no shared file system needed to save).

The keys are those of ``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict``
(``<fqn>`` for every parameter, tied names included, and buffer) and
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` (``state.<fqn>.<key>``
and ``param_groups.<fqn>.<name>``), each tensor in its parameter's shape: the names the
sharded layout uses too (:mod:`dptrain.checkpoint.sharded`), so a run may move between the
two when it resumes (:mod:`dptrain.checkpoint.state`). An ``optimizer.pt`` keyed by
parameter index (dptrain before these names) still loads into a replicated model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["replicated_state", "set_replicated_state", "replica_tensors", "index_keyed", "replicated_files", "FLAT"]

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def replicated_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state of a replicated model under the shared names (see the module docstring)."""
    return get_model_state_dict(module), get_optimizer_state_dict(module, optimizer, options=FLAT)


def replica_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, torch.Tensor]]:
    """What must be equal on every rank: parameters, buffers and (when given) the optimizer's state, by name."""
    named = [(f"parameter {n}", p) for n, p in model.named_parameters()]
    named += [(f"buffer {n}", b) for n, b in model.named_buffers()]
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if torch.is_tensor(value):
                        named.append((f"optimizer state {names.get(id(p), '?')}.{key}", value))
    return named


def index_keyed(optim_state: dict[str, Any]) -> bool:
    """Whether an optimizer state is ``optimizer.state_dict()``'s (by parameter index), as dptrain saved it before."""
    return set(optim_state) == {"state", "param_groups"}


def set_replicated_state(module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                         optim_state: dict[str, Any]) -> None:
    """Load a replicated model and its optimizer from either naming (shared names, or the older index keys)."""
    set_model_state_dict(module, model_state)
    if index_keyed(optim_state):
        optimizer.load_state_dict(optim_state)
    else:
        set_optimizer_state_dict(module, optimizer, optim_state, options=FLAT)


def replicated_files(path: Path, device: torch.device | str = "cpu") -> tuple[dict, dict]:
    """``model.pt`` and ``optimizer.pt`` (on CPU: memory-mapped, read where sliced)."""
    def load(name: str) -> dict:
        mmap = torch.device(device).type == "cpu"
        return torch.load(path / name, map_location=device, weights_only=True, mmap=mmap)
    return load("model.pt"), load("optimizer.pt")
