"""Bytes each rank sends per optimizer step, unit by unit, from the collectives' cost model.

Per step (N ranks; Ψ parameters of b bytes; ring algorithm, which is also what
``native`` is predicted as):

- ``ddp``: each bucket is all-reduced once: 2(N-1)/N x bΨ in total;
- ``zero1`` / ``zero2``: each unit's gradient is reduce-scattered and its parameters
  all-gathered: (N-1)/N x bΨ each, the same total as DDP;
- ``zero3``: the reduce-scatter, plus an all-gather before forward and another before
  backward for each resharding unit (the root unit is gathered once): up to 3/2 of DDP.

Hybrid sharding (``Setup.shard_size`` = k): the reduce-scatters and all-gathers run over
the rank's shard group of k, and each reduced shard is all-reduced over the N/k
replicas: ``across_groups`` counts those bytes, the only ones that leave the shard group
(a host, when k is the ranks per host).

With ``micro_steps`` > 1 (gradient accumulation under ``no_sync``), gradients are
reduced once per step, but stage 3 gathers its units again for every micro-step.
Each number is :func:`dptrain.comm.cost.collective_cost`'s exact ``bytes_sent`` for
the rank, so uneven shards and chunks are counted as the algorithms send them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dptrain.comm.cost import collective_cost
from dptrain.planner.layout import Setup, Unit, units

__all__ = ["Traffic", "step_traffic"]


@dataclass(frozen=True)
class Traffic:
    """One rank's bytes sent per optimizer step, by collective."""

    all_reduce: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0
    across_groups: int = 0  # hybrid sharding: the replicas' all-reduce (included in all_reduce)

    @property
    def total(self) -> int:
        return self.all_reduce + self.reduce_scatter + self.all_gather


def step_traffic(model: nn.Module, setup: Setup, rank: int = 0, algorithm: str = "ring", micro_steps: int = 1,
                 nodes=None, shapes: list[Unit] | None = None) -> Traffic:
    """Bytes rank ``rank`` sends in one optimizer step of ``model`` under ``setup`` (``shapes``: its units, if
    the caller has them)."""
    if micro_steps < 1:
        raise ValueError(f"micro_steps must be >= 1, got {micro_steps}")
    k, replicas = setup.shards, setup.replicas
    nodes = nodes if replicas == 1 else None  # hybrid: the groups are the hierarchy

    costs: dict[tuple, tuple[int, ...]] = {}  # units of one size cost the same: a model's layers repeat

    def sent(collective: str, numel: int, dtype: torch.dtype, n: int = k, r: int = rank % k) -> int:
        key = (collective, numel, dtype.itemsize, n)
        if key not in costs:
            costs[key] = collective_cost(collective, algorithm, numel, dtype.itemsize, n, nodes=nodes).bytes_sent
        return costs[key][r]

    out = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "across_groups": 0}
    for unit in shapes if shapes is not None else units(model, setup):
        if setup.stage == 0:
            out["all_reduce"] += sent("all_reduce", unit.numel, unit.dtype)
            continue
        compute = setup.compute_dtype or unit.dtype
        reduce = setup.reduce_dtype if setup.compute_dtype is not None else compute
        out["reduce_scatter"] += sent("reduce_scatter", unit.numel, reduce)
        gathers = 1 if setup.stage < 3 else micro_steps * (2 if unit.resharded else 1)
        out["all_gather"] += gathers * sent("all_gather", unit.numel, compute)
        if replicas > 1:
            across = sent("all_reduce", unit.shard(k, rank % k), reduce, replicas, rank // k)
            out["all_reduce"] += across
            out["across_groups"] += across
    return Traffic(**out)
