"""Building a ZeRO model's flat units: checks, grouping, flattening, one unit at a time.

``ZeRO.__init__`` calls these in order. :func:`check_policies` refuses options that
cannot run on this group before any communication; :func:`verify_same_model` compares
every rank's parameters and options (ranks with different models would otherwise fail,
or not, one by one); :func:`build_units` groups the parameters (stages 1-2: the DDP
engine's buckets; stage 3: unit modules and a root unit) and, one group at a time,
allocates a meta-device group, takes rank 0's values, and builds the
:class:`~dptrain.zero.unit.FlatUnit` complete, so peak memory is one unit's full buffer.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import nn

from dptrain import comm
from dptrain.ddp.replicas import tensor_signature, verify_replicas
from dptrain.zero.grouping import bucket_groups, materialize_meta, module_groups
from dptrain.zero.hybrid import ShardGroups, check_shard_size
from dptrain.zero.policy import CommPolicy, UnitPolicy, ZeROPolicies
from dptrain.zero.reduction import CommContext
from dptrain.zero.replaced import mark_replaced
from dptrain.zero.unit import FlatUnit, ParamRef
from dptrain.zero.visible import placeholder

__all__ = ["check_policies", "verify_same_model", "build_units", "default_device"]


def check_policies(stage: int, policies: ZeROPolicies, world_size: int) -> None:
    """ValueErrors for options that do not fit together or this world size (each policy checked itself)."""
    policies.units.check_stage(stage)
    c, shard_size = policies.communication, policies.sharding.shard_size
    comm.check_algorithm(c.algorithm, c.nodes, world_size)
    if shard_size is not None and shard_size != world_size:
        check_shard_size(shard_size, world_size)
        if c.algorithm == "hierarchical" or c.compression is not None:
            raise ValueError("shard_size (hybrid sharding) is hierarchical by itself: use algorithm native, ring "
                             "or tree, and no compression")
    if c.compression is not None and c.compression.world_size != world_size:
        raise ValueError(f"the compression's process group has {c.compression.world_size} ranks, ZeRO's has "
                         f"{world_size}: build ShardedCompression on the same group")


def verify_same_model(refs: list[ParamRef], stage: int, policies: ZeROPolicies, shard_size: int,
                      group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Every rank wraps the same parameters with the same options, or every rank raises naming the difference."""
    u, c = policies.units, policies.communication
    signature = tensor_signature([(r.name, r.tensor) for r in refs], "parameter")
    signature.append(("option", "zero", (stage, c.algorithm, [k.__name__ for k in u.unit_classes], u.min_unit_numel,
                                         u.bucket_cap_mb, repr(policies.mixed_precision), _compression_name(c),
                                         shard_size),
                      repr(c.nodes), False))
    verify_replicas(signature, group, device)


def _compression_name(c: CommPolicy) -> str | None:
    z = c.compression
    return None if z is None else f"{type(z.codec).__name__}({z.codec.name}), feedback={z.feedback is not None}"


def build_units(module: nn.Module, refs: list[ParamRef], *, stage: int, policies: ZeROPolicies,
                groups: ShardGroups, context: CommContext, device: torch.device,
                group: dist.ProcessGroup | None) -> list[FlatUnit]:
    """The model's flat units in index order, each built complete (rank 0's values, this rank's shard)."""
    units = []
    for index, (owner, members) in enumerate(_groups(module, refs, stage, policies.units, device)):
        key = _key(policies.units, members[0])  # before flattening: the key may read the parameter's shape
        full = _flatten(members, device, policies.init.init_fn, group)
        units.append(FlatUnit(index, members, full, stage=stage, owner=owner, key=key, groups=groups,
                              communication=policies.communication, sharding=policies.sharding,
                              precision=policies.mixed_precision, context=context))
    return units


def _groups(module: nn.Module, refs: list[ParamRef], stage: int, u: UnitPolicy,
            device: torch.device) -> list[tuple[nn.Module | None, list[ParamRef]]]:
    """(owner module or None, members) per unit: stages 1-2 buckets, stage 3 unit modules and the root."""
    if stage < 3:
        return bucket_groups(refs, u.bucket_cap_mb, device, lambda r: _key(u, r))
    return module_groups(module, refs, tuple(u.unit_classes), u.min_unit_numel, lambda r: _key(u, r))


def _key(u: UnitPolicy, ref: ParamRef) -> Hashable:
    return u.split_by(ref.name, ref.tensor) if u.split_by is not None else None


def _flatten(members: list[ParamRef], device: torch.device, init_fn, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The unit's full flat buffer on ``device``, identical on every rank (rank 0's values).

    The modules' own Parameters stay registered with placeholder data (``visible.py``): from now on
    the unit sets views of the buffer in front of them.
    """
    if any(r.tensor.is_meta for r in members):
        materialize_meta(members, device, init_fn)
    with torch.no_grad():
        full = torch.cat([r.tensor.detach().reshape(-1).to(device) for r in members])
        if dist.get_world_size(group) > 1:
            dist.broadcast(full, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    for ref in members:
        mark_replaced(ref.tensor)  # an optimizer holding it raises (zero/replaced.py)
        ref.tensor.data = placeholder(ref.tensor)
    return full


def default_device(module: nn.Module) -> torch.device:
    """The device of the model's first non-meta parameter, else the current GPU, else the CPU."""
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
