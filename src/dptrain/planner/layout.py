"""What a strategy does with a model's parameters: its communication units and what each rank keeps.

The planner does not re-derive dptrain's layout from formulas: it runs the same
grouping code the engines run (the DDP engine's :func:`~dptrain.ddp.buckets.assign_buckets`,
ZeRO's :func:`~dptrain.zero.grouping.bucket_groups` / :func:`~dptrain.zero.grouping.module_groups`
and :func:`~dptrain.comm.topology.shard_range`) on a model built on the meta device, so
a 70B model is laid out in seconds and the bytes come out exact, uneven shards included.

A :class:`Setup` names the strategy (``ddp``, ``zero1``, ``zero2``, ``zero3``), the
world size, the precision and the engine options that change the layout.
:func:`units` gives the strategy's communication units: the DDP engine's buckets, or
ZeRO's flat units (stages 1-2: buckets; stage 3: one per unit module plus the root).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from dptrain.comm.topology import shard_range
from dptrain.ddp.buckets import ParamInfo, ddp_bucket_layout
from dptrain.strategies import get_strategy, strategy_names
from dptrain.zero.grouping import bucket_groups, collect_params, module_groups
from dptrain.zero.hybrid import check_shard_size

__all__ = ["STRATEGIES", "PRECISIONS", "Setup", "Unit", "units"]

STRATEGIES = strategy_names(lambda s: s.zero_stage is not None)  # those the memory and traffic model covers
PRECISIONS = ("fp32", "bf16")
ZERO_BUCKET_CAP_MB = 4.0  # ZeRO stages 1-2's default


@dataclass(frozen=True)
class Setup:
    """One configuration to plan: a strategy on ``world_size`` ranks in ``precision``.

    ``precision="bf16"``: the DDP engine runs under autocast (parameters, gradients and
    optimizer state stay fp32); ZeRO computes in bf16 from fp32 master shards and
    reduces in ``reduce_dtype`` (fp32 by default, as ``dptrain run``'s ``zero.reduce_dtype``).
    The other fields are the engines' options that change the layout, with the engines'
    defaults (``bucket_cap_mb=None``: 25 MiB for DDP with a 1 MiB first bucket, 4 MiB
    for ZeRO stages 1-2).
    """

    strategy: str
    world_size: int
    precision: str = "fp32"
    reduce_dtype: torch.dtype = torch.float32
    bucket_cap_mb: float | None = None
    last_bucket_cap_mb: float | None = None  # DDP: the gradients ready last in a bucket of their own
    gradient_as_bucket_view: bool = False
    unit_classes: tuple[type, ...] = ()
    min_unit_numel: int | None = None
    reshard_after_forward: bool = True
    split_by: Callable[[str, torch.Tensor], Hashable] | None = field(default=None, compare=False)
    shard_size: int | None = None  # hybrid sharding: ZeRO's units sharded over groups of this many ranks

    def __post_init__(self):
        get_strategy(self.strategy, among=STRATEGIES)  # a ValueError naming the choices
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world size must be a positive integer, got {self.world_size!r}")
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if self.shard_size is not None:
            if self.stage == 0:
                raise ValueError(f"shard_size {self.shard_size} (hybrid sharding) needs a ZeRO strategy")
            check_shard_size(self.shard_size, self.world_size)

    @property
    def shards(self) -> int:
        """Ranks a ZeRO unit is sharded over: the shard group's size (the world without hybrid sharding)."""
        return self.shard_size or self.world_size

    @property
    def replicas(self) -> int:
        """Shard groups holding the same shards (1 without hybrid sharding)."""
        return self.world_size // self.shards

    @property
    def stage(self) -> int:
        return get_strategy(self.strategy).zero_stage

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """ZeRO's parameter dtype for compute (None: the model's own)."""
        return torch.bfloat16 if self.precision == "bf16" and self.stage else None


@dataclass(frozen=True)
class Unit:
    """One communication unit: a DDP bucket or a ZeRO flat unit.

    ``dtype``: the parameters' (master) dtype; ``resharded``: a stage-3 unit freed after
    forward and gathered again in backward (the root unit is kept through the step).
    """

    numel: int
    dtype: torch.dtype
    resharded: bool = False
    names: tuple[str, ...] = ()  # its parameters' qualified names

    def shard(self, world_size: int, rank: int) -> int:
        lo, hi = shard_range(self.numel, world_size, rank)
        return hi - lo


def units(model: nn.Module, setup: Setup) -> list[Unit]:
    """The strategy's units for ``model`` (any device, meta included), as the engine would build them."""
    if setup.stage == 0:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        infos = [ParamInfo(p.numel(), p.element_size(), p.dtype, p.device) for p in params]
        buckets = ddp_bucket_layout(infos, setup.bucket_cap_mb, setup.last_bucket_cap_mb)
        return [Unit(sum(params[i].numel() for i in b), params[b[0]].dtype, names=tuple(named[i][0] for i in b))
                for b in buckets]
    refs, _ = collect_params(model)

    def key(ref):
        return setup.split_by(ref.name, ref.tensor) if setup.split_by is not None else None

    if setup.stage < 3:
        cap = ZERO_BUCKET_CAP_MB if setup.bucket_cap_mb is None else setup.bucket_cap_mb
        groups = bucket_groups(refs, cap, torch.device("meta"), key)
    else:
        groups = module_groups(model, refs, tuple(setup.unit_classes), setup.min_unit_numel, key)
    return [Unit(sum(r.numel for r in members), members[0].tensor.dtype,
                 resharded=setup.stage == 3 and setup.reshard_after_forward and owner is not None,
                 names=tuple(r.name for r in members))
            for owner, members in groups]
