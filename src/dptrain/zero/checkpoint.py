"""Sharded checkpoints of a ZeRO model and its optimizer: DCP files of DTensors, keyed by parameter name.

Each rank writes only what it holds, and a checkpoint saved on N ranks loads on M: the
resharding is done by ``torch.distributed.checkpoint`` (DCP), which reads, for every
chunk a rank asks for, the overlapping parts of the chunks that were saved. Keys are
those of ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``, and
``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True``), so the DDP
engine's checkpoints (:mod:`dptrain.checkpoint.state`) use the same names::

    model.<fqn>                        every parameter (each name of a tied one), buffer and frozen
                                       parameter, in its own shape
    optim.state.<fqn>.<key>            per-element optimizer state (Adam's exp_avg) in the
                                       parameter's shape; scalar state (step) as saved
    optim.param_groups.<fqn>.<name>    the hyperparameters of the parameter's group (lr, betas...)
    extra.<key>                        whatever the caller adds

**Layout.** A tensor is a DTensor ``Shard(0)`` over the ZeRO group (``[Replicate(),
Shard(0)]`` on a 2-D mesh under hybrid sharding, whose replicas DCP writes once): rows
split as ``torch.chunk`` splits them, what FSDP2 saves. ZeRO's own shards are contiguous
ranges of a flat buffer cut wherever a parameter happens to be, which no DTensor
placement describes, so saving first moves each unit's shard, and each per-element
optimizer state, into row chunks with one all-to-all (:mod:`dptrain.zero.redistribute`);
loading asks DCP for row chunks of the current world size and moves them back.

**Why not the helpers themselves.** ``get_model_state_dict`` / ``set_*`` read and write
``module.state_dict()`` and ``optimizer.state_dict()``; ZeRO's optimizer holds one flat
shard per unit, which those helpers would save as ``unit0``, ``unit1``... with no
parameter names. The keys above are theirs; the DTensors are built here.

**Trade-off.** The all-to-all sends each element at most once, only where the two cuts
disagree, and buys a format that FSDP2, torchtitan and the DDP engine read, resharded by
DCP's public planner. Measured on the default chargpt GPT (1.8 M parameters, AdamW, 2
gloo ranks; ``docs/repro/checkpoint_redistribution.py``): the all-to-alls are about a
tenth of a save; the save takes about twice as long as the ShardedTensor one did. The
rest is not broken down; likely DCP's cost per entry (every parameter carries its own
copy of its group's hyperparameters under torch's flattened names), not measured apart.

Loading first compares the checkpoint's parameter names and shapes with the model's
and raises :class:`ShardedCheckpointError` naming every difference, on every rank,
before anything is read. A checkpoint in the format dptrain wrote before (flattened
parameters in ``ShardedTensor`` s) is refused with what to do; :func:`consolidated_state`
still reads it. Saving writes into ``<path>.tmp`` and renames it once DCP has written
its metadata (its last file), so a crash never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dptrain.checkpoint.safe_metadata import dcp_load
from dptrain.checkpoint.sharded import (
    EXTRA,
    MODEL,
    OPTIM,
    ShardedCheckpointError,
    checkpoint_shapes,
    consolidated_state,
    layout_differences,
    local_read,
    placeholder,
    refuse_old_format,
    shapes_of,
    sharded_metadata,
)
from dptrain.utils.weights_file import save_state_file
from dptrain.zero.redistribute import chunk_intervals, chunk_rows, redistribute, zero_intervals
from dptrain.zero.unit import FlatUnit, ParamRef

__all__ = ["ShardedCheckpointError", "save_sharded", "load_sharded", "load_full_state", "consolidated_state",
           "export_safetensors", "parameter_names", "checkpoint_shapes", "layout_differences", "local_read", "MODEL", "OPTIM"]

# --------------------------------------------------------------------- names and layout


def parameter_names(model) -> dict[str, list[str]]:
    """Every name of each trainable parameter (tied ones have several), the first being ``ref.name``."""
    return model.parameter_names


def _refs(model) -> Iterator[ParamRef]:
    return (ref for unit in model.units for ref in unit.refs)


def _mesh(model) -> tuple[DeviceMesh, bool]:
    """The DeviceMesh of the ZeRO group, 2-D (replicate, shard) under hybrid sharding; whether it is hybrid."""
    device = model.device.type
    if model.replicate_group is None:
        return DeviceMesh.from_group(model.shard_group or dist.group.WORLD, device), False
    ranks = dist.get_process_group_ranks(model.group) if model.group is not None else range(dist.get_world_size())
    grid = torch.tensor(list(ranks)).view(-1, model.shard_size)  # shard groups are consecutive ranks (hybrid.py)
    return DeviceMesh.from_group([model.replicate_group, model.shard_group], device, grid,
                                 mesh_dim_names=("replicate", "shard")), True


def _local_shapes(unit: FlatUnit) -> list[torch.Size]:
    """This rank's ``Shard(0)`` chunk shape of each parameter of the unit (a 0-dim one: whole, replicated)."""
    out = []
    for ref in unit.refs:
        first, last = chunk_rows(ref.shape[0], unit.world_size, unit.rank) if len(ref.shape) else (0, 0)
        out.append(torch.Size([last - first, *ref.shape[1:]]) if len(ref.shape) else torch.Size([]))
    return out


def _dtensors(unit: FlatUnit, chunks: torch.Tensor, mesh: DeviceMesh, hybrid: bool) -> list[DTensor]:
    """The unit's parameters as DTensors whose local parts are views of ``chunks`` (this rank's row chunks)."""
    out, at = [], 0
    for ref, local_shape in zip(unit.refs, _local_shapes(unit), strict=True):
        local = chunks[at:at + local_shape.numel()].view(local_shape)
        at += local_shape.numel()
        shard = Shard(0) if len(ref.shape) else Replicate()
        placements = (Replicate(), shard) if hybrid else (shard,)
        out.append(DTensor.from_local(local, mesh, placements, run_check=False, shape=ref.shape,
                                      stride=torch.empty(ref.shape, device="meta").stride()))
    return out


def _to_chunks(unit: FlatUnit, flat_shard: torch.Tensor) -> torch.Tensor:
    """Collective: this rank's ZeRO shard of a unit-shaped tensor -> its row chunks of every parameter."""
    shapes = [r.shape for r in unit.refs]
    return redistribute(flat_shard, zero_intervals(unit.numel, unit.world_size),
                        chunk_intervals(shapes, unit.world_size), unit.group)


def _to_shard(unit: FlatUnit, chunks: torch.Tensor) -> torch.Tensor:
    """Collective: the inverse of :func:`_to_chunks` (replicated 0-dim parameters sent by rank 0 alone)."""
    shapes = [r.shape for r in unit.refs]
    held = chunk_intervals(shapes, unit.world_size)[unit.rank]
    return redistribute(chunks, chunk_intervals(shapes, unit.world_size, sending=True),
                        zero_intervals(unit.numel, unit.world_size), unit.group, held=held)


def _state_kinds(model, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, str]]:
    """Per unit index, ``{key: "element" | "scalar" | "object"}`` of its optimizer state, agreed by every rank.

    Collective: a rank that has not stepped a unit (an empty shard) must still take
    part in its all-to-alls, so the kinds are the union over the ZeRO group.
    """
    mine: dict[int, dict[str, str]] = {}
    for unit in model.units:
        state = optimizer.state.get(unit.shard, {})
        mine[unit.index] = {k: ("element" if torch.is_tensor(v) and v.dim() == 1 and v.shape == unit.shard.shape
                                else "scalar" if torch.is_tensor(v) else "object") for k, v in state.items()}
    if model.world_size == 1:
        return mine
    everyone: list = [None] * model.world_size
    dist.all_gather_object(everyone, mine, group=model.group)
    return {u.index: {k: v for other in everyone for k, v in other[u.index].items()} for u in model.units}


# --------------------------------------------------------------------- save


def save_sharded(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None) -> Path:
    """Collective: every rank writes its row chunks of ``model`` (and ``optimizer``'s state) to ``path``.

    ``extra``: more entries (tensors or picklable objects), saved under ``extra.<key>``
    as they are; a tensor there is taken to be the same on every rank.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    sd = _save_entries(model, optimizer)
    if model.world_size == 1 or dist.get_rank(model.group) == 0:  # the same on every rank: one copy
        sd.update({f"{EXTRA}{k}": v for k, v in (extra or {}).items()})
    dcp.save(sd, checkpoint_id=str(tmp), process_group=model.group)  # returns once the metadata is written
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    dist.barrier()
    return path


def _save_entries(model, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What this rank saves: its row chunks as DTensors; the replicated entries from the group's rank 0 alone.

    Buffers, scalar optimizer state and hyperparameters are the same on every rank; DCP
    would write them once anyway, but each rank's would still travel in the save plans
    gathered to the coordinator, hundreds of small entries per rank. Rank 0 of the group
    holds a non-empty shard of every unit (``shard_range`` gives it the first elements),
    so it has stepped them all.
    """
    mesh, hybrid = _mesh(model)
    names = parameter_names(model)
    lead = model.world_size == 1 or dist.get_rank(model.group) == 0
    sd: dict[str, Any] = {MODEL + k: v for k, v in model.module_state().items()} if lead else {}
    kinds = _state_kinds(model, optimizer) if optimizer is not None else {}
    for unit in model.units:
        tensors = _dtensors(unit, _to_chunks(unit, unit.shard.detach()), mesh, hybrid)
        for ref, tensor in zip(unit.refs, tensors, strict=True):
            sd.update({MODEL + name: tensor for name in names[ref.name]})
        state = optimizer.state.get(unit.shard, {}) if optimizer is not None else {}
        for key, kind in kinds.get(unit.index, {}).items():
            if kind == "element":
                local = state[key].detach() if key in state else unit.shard.new_zeros(unit.shard.shape)
                values = _dtensors(unit, _to_chunks(unit, local), mesh, hybrid)
            elif lead:
                values = [state[key]] * len(unit.refs)
            else:
                continue
            sd.update({f"{OPTIM}state.{ref.name}.{key}": v for ref, v in zip(unit.refs, values, strict=True)})
    for group in optimizer.param_groups if optimizer is not None and lead else []:
        for shard in group["params"]:
            for ref in shard._zero_unit.refs:
                sd.update({f"{OPTIM}param_groups.{ref.name}.{k}": v for k, v in group.items() if k != "params"})
    return sd


# --------------------------------------------------------------------- load


def _model_shapes(model) -> dict[str, list[int]]:
    names = parameter_names(model)
    shapes = {name: list(ref.shape) for ref in _refs(model) for name in names[ref.name]}
    shapes.update({k: list(v.shape) for k, v in model.module_state().items()})
    return shapes


def _check_layout(path: Path, model, saved: dict[str, list[int]]) -> None:
    parts = layout_differences(saved, _model_shapes(model))
    if parts:
        raise ShardedCheckpointError(
            f"checkpoint {path} does not fit this model ({'; '.join(parts)}). Build the model with the "
            "configuration the checkpoint was saved with, or export it (dptrain consolidate) and load "
            "what matches by hand")


def _element_keys(meta: Mapping[str, Any], shapes: Mapping[str, torch.Size]) -> set[str]:
    """Optimizer state keys with one value per element: saved in the shape of a parameter with dimensions."""
    keys = set()
    for k, md in meta.items():
        if k.startswith(OPTIM + "state.") and isinstance(md, TensorStorageMetadata):
            name, _, key = k[len(OPTIM + "state."):].rpartition(".")  # a state key has no dot; a name may
            shape = shapes.get(name)
            if shape is not None and len(shape) and md.size == shape:
                keys.add(key)
    return keys


def load_sharded(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: load ``path`` into ``model``'s shards (and ``optimizer``), on any world size.

    DCP reads this rank's row chunks of the current world size; one all-to-all per unit
    and per-element state moves them into the ZeRO shards. ``extra``: ``{key: default}``
    of extra entries to read back; returns them loaded. Raises
    :class:`ShardedCheckpointError` (on every rank) when parameter names or shapes
    differ from the model's.
    """
    path = Path(path)
    meta = sharded_metadata(path)
    refuse_old_format(path, meta)
    _check_layout(path, model, shapes_of(meta))
    mesh, hybrid = _mesh(model)
    sd: dict[str, Any] = {MODEL + k: v for k, v in model.module_state().items()}  # buffers: in place
    element = _element_keys(meta, {r.name: r.shape for r in _refs(model)}) if optimizer is not None else set()
    chunks: dict[tuple[int, str], torch.Tensor] = {}  # (unit, "" for the parameters or a state key) -> row chunks

    def placeholders(unit: FlatUnit, key: str, dtype: torch.dtype) -> None:
        chunks[unit.index, key] = torch.empty(sum(s.numel() for s in _local_shapes(unit)), dtype=dtype,
                                              device=unit.device)
        names = [MODEL + r.name if not key else f"{OPTIM}state.{r.name}.{key}" for r in unit.refs]
        sd.update(zip(names, _dtensors(unit, chunks[unit.index, key], mesh, hybrid), strict=True))

    for unit in model.units:
        placeholders(unit, "", unit.master_dtype)
        for key in _state_keys(meta, unit) if optimizer is not None else []:
            md = meta[f"{OPTIM}state.{unit.refs[0].name}.{key}"]
            if key in element:
                placeholders(unit, key, md.properties.dtype)
            else:  # scalar state: the unit's first parameter's
                sd[f"{OPTIM}state.{unit.refs[0].name}.{key}"] = placeholder(md, unit.device)
    for group in optimizer.param_groups if optimizer is not None else []:
        if group["params"]:
            first = group["params"][0]._zero_unit.refs[0].name
            sd.update({f"{OPTIM}param_groups.{first}.{k}": None for k in group if k != "params"})
    sd.update({f"{EXTRA}{k}": v for k, v in (extra or {}).items()})
    try:
        with torch.no_grad():
            dcp_load(sd, path, process_group=model.group)
    except dcp.CheckpointException as e:
        raise ShardedCheckpointError(f"checkpoint {path} could not be read into this model and optimizer: {e}. "
                                     "Build the optimizer as the saved run did") from None
    with torch.no_grad():
        for unit in model.units:
            unit.shard.copy_(_to_shard(unit, chunks[unit.index, ""]))
            unit.stale = True  # the next forward gathers the loaded shards
            if optimizer is not None:
                _set_unit_state(optimizer, unit, {
                    key: _to_shard(unit, chunks[unit.index, key]) if (unit.index, key) in chunks
                    else sd[f"{OPTIM}state.{unit.refs[0].name}.{key}"] for key in _state_keys(meta, unit)})
    if optimizer is not None:
        _set_groups(optimizer, lambda name: sd[f"{OPTIM}param_groups.{name}"])
    return {k: sd[f"{EXTRA}{k}"] for k in (extra or {})}


def _state_keys(meta: Mapping[str, Any], unit: FlatUnit) -> list[str]:
    """The optimizer state keys saved for the unit's first parameter (every parameter of a unit has the same)."""
    prefix = f"{OPTIM}state.{unit.refs[0].name}."
    return [k[len(prefix):] for k in meta if k.startswith(prefix)]


def _set_unit_state(optimizer: torch.optim.Optimizer, unit: FlatUnit, state: dict[str, Any]) -> None:
    if state:
        optimizer.state[unit.shard] = state


def _set_groups(optimizer: torch.optim.Optimizer, saved) -> None:
    """Each param group's hyperparameters from its first parameter's saved ones (``saved("<fqn>.<name>")``)."""
    for group in optimizer.param_groups:
        if group["params"]:
            first = group["params"][0]._zero_unit.refs[0].name
            group.update({k: saved(f"{first}.{k}") for k in group if k != "params"})


def load_full_state(model, optimizer: torch.optim.Optimizer | None, model_state: Mapping[str, torch.Tensor],
                    optim_state: Mapping[str, Any] | None, source: str) -> None:
    """Every rank: fill ``model``'s shards (and ``optimizer``) from full tensors under the same keys, no collective.

    ``model_state``: ``{fqn: tensor}``; ``optim_state``: ``{"state.<fqn>.<key>": ...,
    "param_groups.<fqn>.<name>": ...}`` (``get_optimizer_state_dict`` flattened), as the
    DDP engine saves them; memory-mapped tensors are read only where this rank's shard
    falls. ``source`` names them in errors.
    """
    parts = layout_differences({k: list(v.shape) for k, v in model_state.items()}, _model_shapes(model))
    if parts:
        raise ShardedCheckpointError(f"checkpoint {source} does not fit this model ({'; '.join(parts)}). Build the "
                                     "model with the configuration the checkpoint was saved with")
    with torch.no_grad():
        for name, tensor in model.module_state().items():  # buffers, frozen parameters
            tensor.copy_(model_state[name])
        for unit in model.units:
            unit.shard.copy_(_slice_shard(unit, lambda ref: model_state[ref.name], unit.shard.dtype))
            unit.stale = True
            if optimizer is None or optim_state is None:
                continue
            prefix = f"state.{unit.refs[0].name}."
            shaped = next((ref for ref in unit.refs if len(ref.shape)), None)  # tells per-element from scalar
            state = {}
            for key in [k[len(prefix):] for k in optim_state if k.startswith(prefix)]:
                value = optim_state[prefix + key]
                if shaped is not None and torch.is_tensor(optim_state.get(f"state.{shaped.name}.{key}")) \
                        and optim_state[f"state.{shaped.name}.{key}"].shape == shaped.shape:
                    value = _slice_shard(unit, lambda ref, key=key: optim_state[f"state.{ref.name}.{key}"],
                                         value.dtype)
                elif torch.is_tensor(value):
                    value = value.clone()  # not a view into the memory-mapped file, which pruning deletes
                state[key] = value.to(unit.device) if torch.is_tensor(value) and value.dim() else value
            _set_unit_state(optimizer, unit, state)
    if optimizer is not None and optim_state is not None:
        _set_groups(optimizer, lambda name: optim_state[f"param_groups.{name}"])


def _slice_shard(unit: FlatUnit, full_of, dtype: torch.dtype) -> torch.Tensor:
    """This rank's ZeRO shard of the unit, cut from each parameter's full tensor ``full_of(ref)``."""
    pieces = []
    for ref, (start, end) in zip(unit.refs, unit.offsets(), strict=True):
        a, b = max(start, unit.lo), min(end, unit.hi)
        if b > a:
            pieces.append(full_of(ref).reshape(-1)[a - start:b - start])
    if not pieces:
        return torch.empty(0, dtype=dtype, device=unit.device)
    return torch.cat(pieces).to(device=unit.device, dtype=dtype)


# --------------------------------------------------------------------- export


def export_safetensors(model, path: str | os.PathLike) -> Path | None:
    """Collective: gather the full weights; rank 0 writes the wrapped module's whole state dict to ``path`` atomically.

    The keys of ``model.module.state_dict()`` before wrapping: each trained parameter under
    every one of its names (a tied one under each), the buffers and the frozen parameters,
    as the DDP engine's ``model.safetensors`` and ``dptrain consolidate`` write them
    (:mod:`dptrain.utils.weights_file`).
    """
    state = model.full_state_dict()
    path = Path(path)
    if dist.get_rank() == 0:
        save_state_file(state, path)
    dist.barrier()
    return path if dist.get_rank() == 0 else None

