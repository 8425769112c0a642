"""What a strategy does with a model's parameters: its communication units and what each rank keeps.

The planner does not re-derive dptrain's layout from formulas: it runs the same
grouping code the engines run (the DDP engine's :func:`~dptrain.ddp.buckets.assign_buckets`,
ZeRO's :func:`~dptrain.zero.grouping.bucket_groups` / :func:`~dptrain.zero.grouping.module_groups`
and :func:`~dptrain.comm.topology.shard_range`) on a model built on the meta device, so
a 70B model is laid out in seconds and the bytes come out exact, uneven shards included.
It reaches that code through the registry (each planned entry's ``units``), never by
importing a strategy's package.

A :class:`Setup` names a strategy the planner models (:data:`STRATEGIES`: the registry's
``planned`` entries), the world size, the precision and the engine options that change
the layout. :func:`units` gives the strategy's communication units: the DDP engine's
buckets, or ZeRO's flat units (stages 1-2: buckets; stage 3: one per unit module plus
the root).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from dptrain.comm.topology import shard_range
from dptrain.strategies import get_strategy, strategy_names
from dptrain.strategies.requirements import listed

__all__ = ["STRATEGIES", "PRECISIONS", "Setup", "Unit", "units"]

STRATEGIES = strategy_names(lambda s: s.planned)  # those the memory and traffic model covers
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Setup:
    """One configuration to plan: a strategy on ``world_size`` ranks in ``precision``.

    ``precision="bf16"``: the DDP engine runs under autocast (parameters, gradients and
    optimizer state stay fp32); ZeRO computes in bf16 from fp32 master shards and
    reduces in ``reduce_dtype`` (fp32 by default, as ``dptrain run``'s ``zero.reduce_dtype``).
    The other fields are the engines' options that change the layout, with the engines'
    defaults (``bucket_cap_mb=None``: 25 MiB for DDP with a 1 MiB first bucket, 4 MiB
    for ZeRO stages 1-2); each strategy's ``units`` takes those that apply to it.
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
            entry = get_strategy(self.strategy)
            if not entry.shards_parameters:
                sharding = listed(strategy_names(lambda s: s.planned and s.shards_parameters), "or")
                raise ValueError(f"shard_size {self.shard_size} (hybrid sharding) needs a ZeRO strategy, one that "
                                 f"shards: {sharding}, not {self.strategy!r}")
            entry.check_shards(self.shard_size, self.world_size)

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
        """What the memory and traffic formulas take the strategy to shard, as ZeRO's stages count (0: nothing)."""
        return get_strategy(self.strategy).zero_stage

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """ZeRO's parameter dtype for compute (None: the model's own)."""
        return torch.bfloat16 if self.precision == "bf16" and self.stage else None

    @property
    def accumulates_in_place(self) -> bool:
        """ZeRO-1 whose gradients land in its own lasting buffer (computed in the dtype it reduces in): its
        reductions hold no temporary gradient, so none waits for an earlier one (zero/reduction.py)."""
        return self.stage == 1 and self.compute_dtype in (None, self.reduce_dtype)


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
    laid_out = get_strategy(setup.strategy).units(
        model, bucket_cap_mb=setup.bucket_cap_mb, last_bucket_cap_mb=setup.last_bucket_cap_mb,
        unit_classes=tuple(setup.unit_classes), min_unit_numel=setup.min_unit_numel,
        reshard_after_forward=setup.reshard_after_forward, split_by=setup.split_by)
    return [Unit(u.numel, u.dtype, resharded=u.resharded, names=u.names) for u in laid_out]
