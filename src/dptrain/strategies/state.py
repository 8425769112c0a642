"""A checkpoint's model and optimizer state: written by one strategy, read by any (ddp <-> zero1/2/3).

Both strategies write the keys of ``torch.distributed.checkpoint.state_dict``:
``get_model_state_dict`` (``<fqn>`` for every parameter, tied names included, and
buffer) and ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
(``state.<fqn>.<key>`` and ``param_groups.<fqn>.<name>``), each tensor in its
parameter's shape. What differs is the container, chosen for what each strategy holds:

- **replicated** (ddp, gossip): every rank holds everything, so rank 0 alone writes
  ``model.pt`` and ``optimizer.pt`` with ``torch.save``, and saving needs no shared file
  system;
- **sharded** (zero1-3): each rank holds a part, so every rank writes its part into
  ``sharded/`` with DCP, the same keys prefixed ``model.`` and ``optim.``
  (:mod:`dptrain.zero.checkpoint`).

Resuming across strategies reads the other container under the same names:

- a replicated checkpoint into ZeRO: every rank memory-maps the two files and copies
  the slices its shards cover (:func:`~dptrain.zero.checkpoint.load_full_state`; no
  collective, and only those pages are read);
- a sharded checkpoint into DDP: every rank asks DCP for full tensors, into the
  placeholders ``get_model_state_dict`` / ``get_optimizer_state_dict`` return, then
  ``set_model_state_dict`` / ``set_optimizer_state_dict`` apply them.

Older checkpoints: an ``optimizer.pt`` keyed by parameter index (before these names)
still resumes ddp, and is refused by ZeRO before launch with what to do
(:func:`check_strategy_resume`); the older sharded format is refused likewise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dptrain.strategies.registry import SHARDED
from dptrain.zero.checkpoint import (
    MODEL,
    OPTIM,
    ShardedCheckpointError,
    checkpoint_shapes,
    consolidated_state,
    layout_differences,
    load_full_state,
    load_sharded,
    local_read,
)
from dptrain.zero.safe_metadata import dcp_load

__all__ = ["replicated_state", "set_replicated_state", "load_model_and_optimizer", "full_state",
           "check_strategy_resume", "index_keyed"]

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def replicated_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state of a replicated model under the shared names (see the module docstring)."""
    return get_model_state_dict(module), get_optimizer_state_dict(module, optimizer, options=FLAT)


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


def load_model_and_optimizer(path: Path, engine, device: torch.device) -> None:
    """Load checkpoint ``path``'s model and optimizer state into ``engine``, whichever strategy wrote it.

    Collective when ``engine`` is ZeRO and the checkpoint sharded (DCP resharding);
    otherwise each rank reads on its own.
    """
    sharded = (path / SHARDED).is_dir()
    if engine.sharded and sharded:
        load_sharded(path / SHARDED, engine.model, engine.optimizer)
    elif engine.sharded:
        model_state, optim_state = _replicated_files(path)
        if index_keyed(optim_state):
            raise ShardedCheckpointError(_index_keyed_message(path))
        load_full_state(engine.model, engine.optimizer, model_state, optim_state, str(path))
    elif sharded:
        _load_sharded_into_replicated(path / SHARDED, engine.model.module, engine.optimizer)
    else:
        model_state, optim_state = _replicated_files(path, device)
        set_replicated_state(engine.model.module, engine.optimizer, model_state, optim_state)


def _replicated_files(path: Path, device: torch.device | str = "cpu") -> tuple[dict, dict]:
    """``model.pt`` and ``optimizer.pt`` (on CPU: memory-mapped, read where sliced)."""
    def load(name: str) -> dict:
        mmap = torch.device(device).type == "cpu"
        return torch.load(path / name, map_location=device, weights_only=True, mmap=mmap)
    return load("model.pt"), load("optimizer.pt")


def _load_sharded_into_replicated(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: full tensors from a sharded checkpoint into a replicated model and optimizer, no collective."""
    model_state, optim_state = replicated_state(module, optimizer)  # placeholders: the live tensors
    parts = layout_differences(checkpoint_shapes(path), {k: list(v.shape) for k, v in model_state.items()})
    if parts:
        raise ShardedCheckpointError(f"checkpoint {path} does not fit this model ({'; '.join(parts)}). Build the "
                                     "model with the configuration the checkpoint was saved with")
    sd = {"model": model_state, "optim": optim_state}
    try:
        with torch.no_grad(), local_read():
            dcp_load(sd, path, no_dist=True)
    except dcp.CheckpointException as e:
        raise ShardedCheckpointError(f"checkpoint {path} could not be read into this model and optimizer: {e}. "
                                     "Build the optimizer as the saved run did") from None
    set_replicated_state(module, optimizer, sd["model"], sd["optim"])


def full_state(path: Path, optimizer: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model, optimizer) state of checkpoint ``path``, full tensors under the shared names, in this process.

    The optimizer's is ``{}`` unless asked for. Raises :class:`ShardedCheckpointError` for
    an index-keyed ``optimizer.pt`` (its parameters have no names to write them under).
    """
    if (path / SHARDED).is_dir():
        return (consolidated_state(path / SHARDED, MODEL),
                consolidated_state(path / SHARDED, OPTIM) if optimizer else {})
    model_state, optim_state = _replicated_files(path)
    if optimizer and index_keyed(optim_state):
        raise ShardedCheckpointError(_index_keyed_message(path))
    return model_state, optim_state if optimizer else {}


def _index_keyed_message(path: Path) -> str:
    return (f"checkpoint {path} has an optimizer.pt keyed by parameter index (written by a dptrain before "
            "checkpoints named the parameters), which only strategy ddp reads. Resume it once with "
            "ddp.strategy=\"ddp\" until it saves a checkpoint (checkpoint.every), then switch strategy")


def check_strategy_resume(path: Path, saved_format: str, layout: str) -> None:
    """Before launch: a checkpoint of ``saved_format`` can be loaded by a run writing ``layout``, or the reason.

    Raises :class:`ShardedCheckpointError` for the older sharded format (any strategy) and
    for an index-keyed ``optimizer.pt`` resumed by ZeRO.
    """
    if saved_format == "sharded":
        checkpoint_shapes(path / SHARDED)  # refuses the older format with what to do
    elif saved_format == "replicated" and layout == "sharded":
        optim_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True, mmap=True)
        if index_keyed(optim_state):
            raise ShardedCheckpointError(_index_keyed_message(path))
