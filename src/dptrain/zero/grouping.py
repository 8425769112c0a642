"""Which parameters form which flat unit, and building a unit's parameters on the meta device.

ZeRO shards *units*, groups of parameters flattened into one buffer (see
:mod:`dptrain.zero.unit`). This module decides the groups, before anything is flattened:

- :func:`collect_params`: every trainable parameter once, with every (module,
  attribute) that holds it, so tied weights are one entry with several holders;
- :func:`bucket_groups` (stages 1-2): the DDP engine's buckets
  (:func:`~dptrain.ddp.buckets.assign_buckets`: gradient-ready order, a size cap);
- :func:`module_groups` (stage 3): one unit per *unit module* (outermost instances of
  the chosen classes, or modules reaching a size bottom-up) plus a root unit with
  everything outside them, including parameters shared across unit modules;
- either way, parameters whose ``key`` differs (``ZeRO(split_by=...)``) never share a
  unit, so an optimizer can give the units different hyperparameters.

:func:`materialize_meta` allocates and initialises one unit's parameters that were
built on the meta device, so the full model never exists on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from dptrain.ddp.buckets import MiB, ParamInfo, assign_buckets
from dptrain.utils.modules import outermost
from dptrain.zero.unit import ParamRef

__all__ = ["collect_params", "bucket_groups", "module_groups", "materialize_meta", "outermost"]

Group = tuple["nn.Module | None", list[ParamRef]]  # (the unit module, or None for buckets and the root; members)
KeyFn = Callable[[ParamRef], Hashable]


def collect_params(module: nn.Module) -> tuple[list[ParamRef], list[nn.Parameter]]:
    """Trainable parameters (deduplicated, tied ones once, with every holder) and frozen ones."""
    holders: dict[int, list] = {}
    tensors: dict[int, nn.Parameter] = {}
    names: dict[int, str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            key = id(p)
            if key not in tensors:
                tensors[key], names[key], holders[key] = p, f"{prefix}.{attr}" if prefix else attr, []
            if (sub, attr) not in [(m, a) for m, a in holders[key]]:
                holders[key].append((sub, attr))
    refs = [ParamRef(names[k], tensors[k].shape, tuple(holders[k]), tensors[k])
            for k in tensors if tensors[k].requires_grad]
    frozen = [tensors[k] for k in tensors if not tensors[k].requires_grad]
    if not refs:
        raise ValueError("ZeRO: the module has no parameter that requires grad; nothing to shard")
    return refs, frozen


def bucket_groups(refs: list[ParamRef], cap_mb: float, device: torch.device, key: KeyFn) -> list[Group]:
    """Stages 1-2: the DDP engine's buckets, one unit each (a key joins dtype and device in the bucket rule)."""
    infos = [ParamInfo(r.numel, r.tensor.element_size(), r.tensor.dtype, device, key(r)) for r in refs]
    buckets = assign_buckets(infos, int(cap_mb * MiB), first_cap_bytes=min(MiB, int(cap_mb * MiB)))
    return [(None, [refs[i] for i in sorted(b)]) for b in buckets]


def module_groups(root: nn.Module, refs: list[ParamRef], classes: tuple, min_numel: int | None,
                  key: KeyFn) -> list[Group]:
    """Stage 3: a unit per unit module (split by key), then the root unit's parts."""
    owners = _unit_modules(root, classes, min_numel)
    owned: dict[nn.Module, list[ParamRef]] = {m: [] for m in owners}
    owner_of = {id(m): owner for owner in owners for m in owner.modules()}
    rest: list[ParamRef] = []
    for ref in refs:
        homes = {owner_of.get(id(module)) for module, _ in ref.holders}
        home = homes.pop() if len(homes) == 1 else None  # shared across units (tied): the root's
        (owned[home] if home is not None else rest).append(ref)
    groups: list[Group] = [(m, part) for m in owners for part in _split(owned[m], key)]
    for module, members in groups:
        dtypes = {r.tensor.dtype for r in members}
        if len(dtypes) > 1:
            raise ValueError(f"unit {type(module).__name__} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "a flat unit has one dtype: cast the model first (model.float()) or choose "
                             "unit_classes whose parameters share a dtype")
    return groups + [(None, part) for part in _split(rest, key)]


def _split(members: list[ParamRef], key: KeyFn) -> list[list[ParamRef]]:
    """``members`` in groups of one key each, in order of each key's first parameter."""
    parts: dict[Hashable, list[ParamRef]] = {}
    for ref in members:
        parts.setdefault(key(ref), []).append(ref)
    return list(parts.values())


def _unit_modules(root: nn.Module, classes: tuple, min_numel: int | None) -> list[nn.Module]:
    """Stage 3's unit modules in registration order: outermost instances of ``classes``, or size-based."""
    if classes:
        found = outermost(root, classes)
        if not found:
            present = sorted({type(m).__name__ for m in root.modules()})
            raise ValueError(f"unit_classes {[c.__name__ for c in classes]} do not occur in the model; its "
                             f"module classes are {present}")
        return found
    if min_numel:
        found, taken = [], set()

        def visit(module: nn.Module) -> int:
            size = sum(visit(child) for child in module.children())
            size += sum(p.numel() for p in module._parameters.values() if p is not None and id(p) not in taken)
            if module is not root and size >= min_numel:
                found.append(module)
                taken.update(id(p) for p in module.parameters())
                return 0
            return size

        visit(root)
        order = {id(m): i for i, m in enumerate(root.modules())}
        return sorted(found, key=lambda m: order[id(m)])
    return []


def materialize_meta(members: list[ParamRef], device: torch.device, init_fn) -> None:
    """Allocate a unit's meta parameters on ``device`` and initialise them (tied holders re-tied)."""
    modules = []
    for ref in members:
        real = nn.Parameter(torch.empty(ref.shape, dtype=ref.tensor.dtype, device=device))
        for module, attr in ref.holders:
            module._parameters[attr] = real
            if module not in modules:
                modules.append(module)
        ref.tensor = real
    with torch.no_grad():
        for module in modules:
            if init_fn is not None:
                init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                raise ValueError(f"cannot initialise {type(module).__name__} built on the meta device: it has no "
                                 "reset_parameters(); pass init_fn=... to ZeRO")
