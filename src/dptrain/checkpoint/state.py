"""A checkpoint's model and optimizer state: written under one layout, read by a wrapper of any (ddp <-> zero1/2/3).

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
  (:mod:`dptrain.checkpoint.sharded`; the wrapper's own ``save_sharded``).

Resuming across strategies reads the other container under the same names:

- a replicated checkpoint into a sharding wrapper: every rank memory-maps the two files
  and the wrapper copies the slices its shards cover (its ``load_full_state``; no
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

from dptrain.checkpoint.replicated import index_keyed, replicated_files, replicated_state, set_replicated_state
from dptrain.checkpoint.safe_metadata import dcp_load
from dptrain.checkpoint.sharded import (
    MODEL,
    OPTIM,
    SHARDED,
    ShardedCheckpointError,
    checkpoint_shapes,
    consolidated_state,
    layout_differences,
    local_read,
)

__all__ = ["load_model_and_optimizer", "full_state", "check_strategy_resume"]


def load_model_and_optimizer(path: Path, engine: Any, device: torch.device) -> None:
    """Load checkpoint ``path``'s model and optimizer state into ``engine`` (its ``model`` wrapper and
    ``optimizer``), whichever layout wrote it; ``engine.sharded``: its strategy keeps the sharded layout.

    A sharding wrapper reads through its own ``load_sharded`` (collective: DCP reshards) and
    ``load_full_state`` (a replicated checkpoint, no collective); a replicated one through
    ``set_model_state_dict`` on its ``module``, each rank on its own.
    """
    wrapper, optimizer = engine.model, engine.optimizer
    saved_sharded = (path / SHARDED).is_dir()
    if engine.sharded and saved_sharded:
        wrapper.load_sharded(path / SHARDED, optimizer)
    elif engine.sharded:
        model_state, optim_state = replicated_files(path)
        if index_keyed(optim_state):
            raise ShardedCheckpointError(_index_keyed_message(path))
        wrapper.load_full_state(optimizer, model_state, optim_state, str(path))
    elif saved_sharded:
        _load_sharded_into_replicated(path / SHARDED, wrapper.module, optimizer)
    else:
        model_state, optim_state = replicated_files(path, device)
        set_replicated_state(wrapper.module, optimizer, model_state, optim_state)


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
    if (path / "ps").is_dir() and not (path / "model.pt").exists():
        raise ShardedCheckpointError(
            f"checkpoint {path} is a parameter server's (format ps): each server saved its flat shard with no "
            "parameter names, which only the job that wrote it can lay out again. The run's weights are its "
            "model.safetensors; resume the run to read the checkpoint")
    model_state, optim_state = replicated_files(path)
    if optimizer and index_keyed(optim_state):
        raise ShardedCheckpointError(_index_keyed_message(path))
    return model_state, optim_state if optimizer else {}


def _index_keyed_message(path: Path) -> str:
    return (f"checkpoint {path} has an optimizer.pt keyed by parameter index (written by a dptrain before "
            "checkpoints named the parameters), which only strategy ddp reads. Resume it once with "
            "distributed.strategy=\"ddp\" until it saves a checkpoint (checkpoint.every), then switch strategy")


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
