"""One safetensors file of a checkpoint's full weights, in one process: what ``dptrain consolidate`` writes.

No process group and no GPU: a sharded checkpoint's ``sharded/`` is read by DCP, every
chunk of each parameter into one tensor (whatever the world size that wrote it); a
replicated one's ``model.pt`` is memory-mapped. The names are the model's own
(``get_model_state_dict``'s: tied parameters under each name, buffers included), so
``model.load_state_dict(safetensors.torch.load_file(path))`` loads it: the rule of a
run's ``model.safetensors`` under every strategy (:mod:`dptrain.utils.weights_file`). With the
optimizer, its per-parameter state follows under ``optim.state.<fqn>.<key>`` and the
hyperparameters of each parameter's group go into the file's metadata (JSON under
``optim.param_groups``), safetensors holding tensors only.

The checkpoint is checked as a resume checks it before anything is read: ``meta.json``
present and intact, every file matching its sha256
(:func:`~dptrain.checkpoint.files.verify_files`); a truncated, partial or foreign one is
a :class:`ConsolidateError`. It is held against the rotation of a run still writing it
(:func:`~dptrain.checkpoint.files.reading`) while it is read, and ``sharded/.metadata``
is read without running code (:mod:`dptrain.checkpoint.safe_metadata`).

The file is written beside its destination under a temporary name and renamed over it
(:func:`dptrain.utils.atomic.replacing`): a reader sees the old file or the new one.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain.checkpoint.files import SHARDED, CheckpointError, find_latest, reading, verify_files
from dptrain.checkpoint.state import full_state
from dptrain.utils.weights_file import save_state_file

__all__ = ["ConsolidateError", "Consolidated", "find_checkpoint", "consolidate_checkpoint"]


class ConsolidateError(ValueError):
    """A path that holds no checkpoint, or a checkpoint that cannot be written out as asked."""


@dataclass(frozen=True)
class Consolidated:
    checkpoint: Path   # the checkpoint directory read
    output: Path
    tensors: int       # entries written
    numel: int         # their elements, together
    size_bytes: int    # the file's size


def find_checkpoint(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, its newest ``step_*`` (a run directory), or above ``sharded/``.

    Raises :class:`ConsolidateError` naming what was looked for.
    """
    path = Path(path)
    if not path.exists():
        raise ConsolidateError(f"{path} does not exist; give a run directory, a checkpoint directory "
                               "(checkpoints/step_*) or its sharded/ directory")
    if path.name == SHARDED and path.is_dir():  # the reader names what it lacks
        return path.parent
    if (path / SHARDED).is_dir() or (path / "model.pt").is_file() or (path / "meta.json").is_file():
        return path  # verify_files names what a partial one lacks
    latest = find_latest(path)
    if latest is not None:
        return latest
    raise ConsolidateError(f"{path} is not a dptrain checkpoint: it has no model.pt (ddp), no sharded/ (zero1-3) "
                           "and no checkpoints/step_* (a run directory). Give a run directory, a checkpoint "
                           "directory (checkpoints/step_*) or its sharded/ directory")


def consolidate_checkpoint(path: Path, output: Path, optimizer: bool = False) -> Consolidated:
    """Write the full weights of the checkpoint ``path`` names (:func:`find_checkpoint`) to ``output``, atomically."""
    checkpoint, model_state, optim_state = _read_checked(path, optimizer)
    tensors = {k: v for k, v in model_state.items() if torch.is_tensor(v)}
    tensors.update({f"optim.{k}": v for k, v in optim_state.items() if k.startswith("state.") and torch.is_tensor(v)})
    metadata = {"format": "pt", "checkpoint": str(checkpoint)}
    if optimizer:
        groups = {k[len("param_groups."):]: v for k, v in optim_state.items() if k.startswith("param_groups.")}
        metadata["optim.param_groups"] = json.dumps(groups, default=_plain)
    output = save_state_file(tensors, Path(output), metadata)
    return Consolidated(checkpoint, output, len(tensors), sum(t.numel() for t in tensors.values()),
                        output.stat().st_size)


# What reading a damaged checkpoint raises past the checksums (a meta.json rewritten to match, say).
_UNREADABLE = (ValueError, OSError, EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile)


def _read_checked(path: Path, optimizer: bool) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    """(checkpoint, model state, optimizer state) of the checkpoint ``path`` names, verified and held while read.

    A run directory's newest checkpoint may be rotated away between finding and holding
    it: then the newest is looked up again (once).
    """
    for attempt in range(2):
        checkpoint = find_checkpoint(path)
        try:
            with reading(checkpoint):
                verify_files(checkpoint, fix=_FIX)
                return (checkpoint, *full_state(checkpoint, optimizer=optimizer))
        except CheckpointError as e:
            if attempt or checkpoint.exists() or checkpoint == Path(path):
                raise ConsolidateError(str(e)) from None
        except _UNREADABLE as e:  # ShardedCheckpointError (a ValueError) included
            raise ConsolidateError(f"checkpoint {checkpoint} could not be read: {e}") from None
    raise AssertionError("unreachable")  # pragma: no cover


_FIX = "export an earlier checkpoint (checkpoints/step_*), or the run directory once it has saved a complete one"


def _plain(value: Any) -> Any:
    """JSON for hyperparameters that are not plain numbers (a tensor lr)."""
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else str(value)
