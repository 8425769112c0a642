"""Sharded checkpoints of a ZeRO model and its optimizer, with ``torch.distributed.checkpoint``.

Each rank writes only what it owns, and a checkpoint saved on N ranks loads on M: the
resharding is done by ``torch.distributed.checkpoint`` (DCP), which reads, for every
tensor a rank asks for, the overlapping pieces of the chunks that were saved.

What makes that possible is the layout the checkpoint is written in. It is not the
units' flat buffers (their shard boundaries depend on the world size) but the model's
own parameters, by their original names, each *flattened* to 1-D. Rank r's shard of a
unit covers the elements ``[lo_r, hi_r)`` of the flat buffer; intersected with a
parameter's ``[start, end)`` that is one contiguous piece of the flattened parameter,
saved as one chunk of a ``ShardedTensor`` whose global layout every rank computes
without communication (:func:`~dptrain.comm.topology.shard_range` of every rank).
Optimizer state that has one value per element (Adam's ``exp_avg``) is saved the same
way; scalar state (``step``) once per parameter. Keys::

    model.<name>             the flattened parameter (ShardedTensor, numel elements)
    optim.<name>.<key>       per-element state (ShardedTensor) or scalar state (tensor)
    shapes                   JSON {name: shape}: what the flattened parameters are reshaped to
    optim.groups             JSON: the optimizer's hyperparameters, one dict per param group
    optim.kinds              JSON {key: "sharded" | "scalar"}
    extra.<key>              whatever the caller adds (step counters, RNG states...)

Loading first compares the checkpoint's parameter names and shapes with the model's
and raises :class:`ShardedCheckpointError` naming every difference, on every rank,
before anything is read. Saving writes into ``<path>.tmp`` and renames it once DCP has
written its metadata (its last file), so a crash never leaves a checkpoint that looks
complete. :func:`consolidated_state` reads a checkpoint back into full tensors in one
process (no process group); :func:`export_safetensors` writes the live model's full
weights from rank 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from dptrain import comm
from dptrain.zero.unit import FlatUnit

__all__ = ["ShardedCheckpointError", "save_sharded", "load_sharded", "consolidated_state", "export_safetensors",
           "checkpoint_shapes"]


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint that does not fit the model it is loaded into."""


# --------------------------------------------------------------------- layout


def _pieces(unit: FlatUnit) -> list[tuple[Any, int, int, list[tuple[int, int, int]]]]:
    """Per parameter of ``unit``: (ref, this rank's start in the shard, length, every rank's (rank, offset, size))."""
    bounds = [comm.shard_range(unit.numel, unit.world_size, r) for r in range(unit.world_size)]
    out = []
    for ref, (start, end) in zip(unit.refs, unit.offsets()):
        everyone = []
        for r, (lo, hi) in enumerate(bounds):
            a, b = max(start, lo), min(end, hi)
            if b > a:
                everyone.append((r, a - start, b - a))
        a, b = max(start, unit.lo), min(end, unit.hi)
        out.append((ref, a - unit.lo, max(b - a, 0), everyone))
    return out


def _sharded(unit: FlatUnit, local: torch.Tensor, numel: int, pieces: list[tuple[int, int, int]]) -> ShardedTensor:
    """A 1-D ShardedTensor of ``numel`` elements whose chunk on this rank is ``local``."""
    device = local.device
    place = [(dist.get_global_rank(unit.group, r) if unit.group is not None else r, offset, size)
             for r, offset, size in pieces]
    metas = [ShardMetadata(shard_offsets=[offset], shard_sizes=[size], placement=f"rank:{g}/{device}")
             for g, offset, size in place]
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    global_meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([numel]), tensor_properties=props)
    me = dist.get_rank()
    local_shards = [Shard(local, meta) for (g, _, _), meta in zip(place, metas) if g == me]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, global_meta,
                                                                      process_group=unit.group)


def _state_dict(model, optimizer: torch.optim.Optimizer | None, states: dict | None) -> dict[str, Any]:
    """The DCP state dict over the tensors themselves (views), for saving from or loading into."""
    sd: dict[str, Any] = {"shapes": json.dumps({r.name: list(r.shape) for u in model.units for r in u.refs})}
    kinds: dict[str, str] = {}
    for unit in model.units:
        shard = unit.shard.detach()
        unit_state = states[unit] if states is not None else {}
        for ref, begin, length, everyone in _pieces(unit):
            sd[f"model.{ref.name}"] = _sharded(unit, shard[begin:begin + length], ref.numel, everyone)
            for key, value in unit_state.items():
                if not torch.is_tensor(value):
                    continue
                if value.dim() == 1 and value.shape == unit.shard.shape:
                    kinds[key] = "sharded"
                    sd[f"optim.{ref.name}.{key}"] = _sharded(unit, value[begin:begin + length], ref.numel, everyone)
                else:
                    kinds[key] = "scalar"
                    sd[f"optim.{ref.name}.{key}"] = value
    if optimizer is not None:
        sd["optim.groups"] = json.dumps([{k: v for k, v in g.items() if k != "params"}
                                         for g in optimizer.param_groups], default=_plain)
        sd["optim.kinds"] = json.dumps(kinds)
    return sd


@contextlib.contextmanager
def _quiet():
    """DCP warns that ShardedTensor is deprecated in favour of DTensor each time it touches one.

    DTensor's Shard placement splits a tensor the way ``torch.chunk`` does, which cannot
    describe a piece of a parameter cut at an arbitrary flat-buffer boundary; the
    ShardedTensor metadata can, and DCP reads and reshards it. A single-process read
    (``no_dist``) warns that it is one, which is what it is meant to be.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        yield


def _plain(value: Any) -> Any:
    """JSON for optimizer hyperparameters that are not plain numbers (a tensor lr, a tuple)."""
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else str(value)


# --------------------------------------------------------------------- save / load


def save_sharded(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None) -> Path:
    """Collective: every rank writes its shards of ``model`` (and ``optimizer``'s state) to ``path``.

    ``extra``: more entries (tensors or picklable objects), saved under ``extra.<key>``
    as they are; a tensor there is taken to be the same on every rank.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    states = {u: optimizer.state.get(u.shard, {}) for u in model.units} if optimizer is not None else None
    sd = _state_dict(model, optimizer, states)
    sd.update({f"extra.{k}": v for k, v in (extra or {}).items()})
    with _quiet():
        dcp.save(sd, checkpoint_id=str(tmp))  # returns on every rank once the metadata file is written
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    dist.barrier()
    return path


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """``{name: shape}`` of the parameters in a sharded checkpoint (read locally, no collective)."""
    return _read_json(path, ("shapes",))["shapes"]


def _read_json(path: str | os.PathLike, keys: tuple[str, ...]) -> dict[str, Any]:
    """The checkpoint's JSON entries ``keys``, in one local read."""
    if not (Path(path) / ".metadata").is_file():
        raise ShardedCheckpointError(f"{path} is not a dptrain sharded checkpoint: it has no .metadata file "
                                     "(written last by a complete save)")
    sd: dict[str, Any] = {key: "" for key in keys}
    try:
        with _quiet():
            dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    except Exception as e:  # DCP raises CheckpointException / FileNotFoundError / RuntimeError
        raise ShardedCheckpointError(f"{path} is not a readable dptrain sharded checkpoint: {e}") from None
    return {key: json.loads(sd[key]) for key in keys}


def _check_layout(path: Path, model, saved: dict[str, list[int]]) -> None:
    mine = {r.name: list(r.shape) for u in model.units for r in u.refs}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    differ = [f"{n} (checkpoint {tuple(saved[n])}, model {tuple(mine[n])})"
              for n in sorted(set(mine) & set(saved)) if saved[n] != mine[n]]
    if missing or unexpected or differ:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
        if differ:
            parts.append(f"shapes differ: {', '.join(differ)}")
        raise ShardedCheckpointError(
            f"checkpoint {path} does not fit this model ({'; '.join(parts)}). Build the model with the "
            "configuration the checkpoint was saved with, or export it (consolidated_state) and load "
            "what matches by hand")


def load_sharded(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: load ``path`` into ``model``'s shards (and ``optimizer``), on any world size.

    ``extra``: ``{key: default}`` of extra entries to read back; returns them loaded.
    Raises :class:`ShardedCheckpointError` (on every rank) when parameter names or
    shapes differ from the model's.
    """
    path = Path(path)
    head = _read_json(path, ("shapes", "optim.kinds", "optim.groups") if optimizer is not None else ("shapes",))
    _check_layout(path, model, head["shapes"])
    kinds: dict[str, str] = head.get("optim.kinds", {})
    groups: list = head.get("optim.groups", [])
    if optimizer is not None:
        if len(groups) != len(optimizer.param_groups):
            raise ShardedCheckpointError(
                f"checkpoint {path} has {len(groups)} optimizer param groups, this optimizer "
                f"{len(optimizer.param_groups)}; build the optimizer as the saved run did")
    states = None
    if optimizer is not None:
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        states = {}
        for unit in model.units:
            first = unit.refs[0].name
            states[unit] = {}
            for key, kind in kinds.items():
                md = meta.get(f"optim.{first}.{key}")
                if md is None:
                    continue  # this unit had no such state (e.g. never stepped)
                dtype = md.properties.dtype
                states[unit][key] = (torch.zeros(unit.shard.shape, dtype=dtype, device=unit.shard.device)
                                     if kind == "sharded" else torch.zeros(md.size, dtype=dtype))
    sd = _state_dict(model, optimizer, states)
    if optimizer is not None:  # scalars are read per unit from its first parameter only
        for unit in model.units:
            for ref in unit.refs[1:]:
                for key, kind in kinds.items():
                    if kind == "scalar":
                        sd.pop(f"optim.{ref.name}.{key}", None)
        sd.pop("optim.groups")
        sd.pop("optim.kinds")
    sd.update({f"extra.{k}": v for k, v in (extra or {}).items()})
    with torch.no_grad(), _quiet():
        dcp.load(sd, checkpoint_id=str(path))
    for unit in model.units:
        unit.stale = True  # the next forward gathers the loaded shards
    if optimizer is not None:
        for unit in model.units:
            if states[unit]:
                optimizer.state[unit.shard] = states[unit]
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
    return {k: sd[f"extra.{k}"] for k in (extra or {})}


# --------------------------------------------------------------------- export


def consolidated_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every parameter of a sharded checkpoint, full and in its shape, read in this process alone."""
    shapes = checkpoint_shapes(path)
    sd: dict[str, Any] = {}
    with _quiet():
        _load_state_dict(sd, storage_reader=dcp.FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return {name: sd[f"model.{name}"].reshape(shape) for name, shape in shapes.items()}


def export_safetensors(model, path: str | os.PathLike) -> Path | None:
    """Collective: gather the full weights; rank 0 writes them to ``path`` (safetensors) atomically."""
    from safetensors.torch import save_file

    state = model.gathered_state()
    path = Path(path)
    if dist.get_rank() == 0:
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp))
        os.replace(tmp, path)
    dist.barrier()
    return path if dist.get_rank() == 0 else None
