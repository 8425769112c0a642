"""The sharded checkpoint format: DCP files of DTensors keyed by parameter name, read without running code.

A strategy that shards the parameters (ZeRO) writes ``sharded/`` with
``torch.distributed.checkpoint`` (DCP): each rank its row chunks of every parameter and of
its per-element optimizer state, DTensors ``Shard(0)`` over the group, under the names of
``torch.distributed.checkpoint.state_dict``::

    model.<fqn>                        every parameter (each name of a tied one), buffer and frozen
                                       parameter, in its own shape
    optim.state.<fqn>.<key>            per-element optimizer state (Adam's exp_avg) in the
                                       parameter's shape; scalar state (step) as saved
    optim.param_groups.<fqn>.<name>    the hyperparameters of the parameter's group (lr, betas...)
    extra.<key>                        whatever the caller adds

This module is the format, apart from any strategy: reading a checkpoint's metadata
(never with plain pickle: :mod:`dptrain.checkpoint.safe_metadata`), its names and shapes,
and every entry as a full tensor in one process (``dptrain consolidate``, a replicated
model resumed from a sharded checkpoint). Writing and resharding into a wrapper's own
shards is the wrapper's (``save_sharded`` / ``load_sharded``, ZeRO's in
:mod:`dptrain.zero.checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from dptrain.checkpoint.files import SHARDED  # a checkpoint's subdirectory that every rank writes into
from dptrain.checkpoint.safe_metadata import UnsafeCheckpointError, dcp_load, read_metadata

__all__ = ["MODEL", "OPTIM", "EXTRA", "SHARDED", "ShardedCheckpointError", "sharded_metadata", "refuse_old_format",
           "layout_differences", "checkpoint_shapes", "shapes_of", "placeholder", "local_read", "consolidated_state"]

MODEL, OPTIM, EXTRA = "model.", "optim.", "extra."  # key prefixes (get_state_dict's "model" and "optim")


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint that does not fit the model it is loaded into."""


@contextlib.contextmanager
def local_read() -> Iterator[None]:
    """A local read (``no_dist``) warns that it is one, which is what it is meant to be."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        yield


def sharded_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's ``{key: storage metadata}``, read locally (no collective)."""
    if not (path / ".metadata").is_file():
        raise ShardedCheckpointError(f"{path} is not a dptrain sharded checkpoint: it has no .metadata file "
                                     "(written last by a complete save)")
    try:
        return read_metadata(path).state_dict_metadata  # never plain pickle: it could run code
    except UnsafeCheckpointError as e:
        raise ShardedCheckpointError(str(e)) from None
    except Exception as e:  # a truncated or foreign .metadata: pickle, EOF or attribute errors
        raise ShardedCheckpointError(f"{path} is not a readable dptrain sharded checkpoint: {e}") from None


def refuse_old_format(path: Path, meta: Mapping[str, Any]) -> None:
    if "shapes" in meta:
        raise ShardedCheckpointError(
            f"{path} is in the sharded format dptrain wrote before DTensor checkpoints (flattened parameters in "
            "ShardedTensors), which cannot be resumed by this version. Export its weights with `dptrain "
            f"consolidate {path.parent if path.name == 'sharded' else path}` (which reads it), resume it with the "
            "dptrain version that wrote it, or start afresh with another run_dir")


def layout_differences(saved: Mapping[str, list[int]], mine: Mapping[str, list[int]]) -> list[str]:
    """What differs between a checkpoint's ``{name: shape}`` and a model's: missing, unexpected, other shapes."""
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    differ = [f"{n} (checkpoint {tuple(saved[n])}, model {tuple(mine[n])})"
              for n in sorted(set(mine) & set(saved)) if list(saved[n]) != list(mine[n])]
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
    if differ:
        parts.append(f"shapes differ: {', '.join(differ)}")
    return parts


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """``{name: shape}`` of the model entries of a sharded checkpoint (read locally, no collective)."""
    path = Path(path)
    meta = sharded_metadata(path)
    refuse_old_format(path, meta)
    return shapes_of(meta)


def shapes_of(meta: Mapping[str, Any]) -> dict[str, list[int]]:
    return {k[len(MODEL):]: list(md.size) for k, md in meta.items()
            if k.startswith(MODEL) and isinstance(md, TensorStorageMetadata)}


def placeholder(md: Any, device: torch.device) -> Any:
    """An entry for DCP to load a scalar into: a tensor of the saved size and dtype, or anything for bytes."""
    if isinstance(md, BytesStorageMetadata):
        return None
    return torch.empty(md.size, dtype=md.properties.dtype, device=device if len(md.size) else "cpu")


def consolidated_state(path: str | os.PathLike, prefix: str = MODEL) -> dict[str, Any]:
    """Every entry under ``prefix`` (``model.``: parameters by name, ``optim.``: optimizer state), full, in one process.

    No process group: DCP reads every chunk of each entry into one tensor. Also reads the
    older flattened format (its ``shapes`` entry gives each parameter's shape).
    """
    path = Path(path)
    meta = sharded_metadata(path)
    sd = {k: placeholder(md, torch.device("cpu")) for k, md in meta.items() if k.startswith(prefix)}
    old = "shapes" in meta
    if old and prefix != MODEL:
        raise ShardedCheckpointError(f"{path} is in the older sharded format, whose optimizer state is not saved "
                                     "by parameter name; only its weights can be read (leave out the optimizer)")
    if old:
        sd["shapes"] = ""
    try:
        with local_read():
            dcp_load(sd, path, no_dist=True)
    except Exception as e:  # DCP raises CheckpointException / FileNotFoundError / RuntimeError
        raise ShardedCheckpointError(f"{path} is not a readable dptrain sharded checkpoint: {e}") from None
    if old:
        shapes = json.loads(sd.pop("shapes"))
        return {k[len(prefix):]: v.reshape(shapes[k[len(MODEL):]]) if k[len(MODEL):] in shapes else v
                for k, v in sd.items()}
    return {k[len(prefix):]: v for k, v in sd.items()}
