"""Hybrid sharding (HSDP): shard within a group of ranks, replicate across groups.

ZeRO-3 over N ranks all-gathers every unit's parameters twice a step and
reduce-scatters its gradient once, each across all N ranks: on a cluster whose hosts
are joined by a slower fabric than the links inside a host, most of those bytes cross
it. Hybrid sharding splits the N ranks into N/k *shard groups* of k consecutive ranks
(a host's ranks) and shards each unit over its shard group only; the k-way all-gathers
and reduce-scatters stay inside the host. The R = N/k ranks holding the same shard (the
same position in every shard group) form a *replicate group*: after its reduce-scatter,
each rank all-reduces its gradient shard over the replicate group, the only collective
that crosses hosts, carrying 1/k of the gradient (Zhao et al., "PyTorch FSDP", VLDB
2023, section 3.2.3, hybrid sharding; DeepSpeed's MiCS and ZeRO++'s hierarchical
partitioning are the same idea).

Averaging: the reduce-scatter averages over the k ranks of a shard group and the
all-reduce over the R replicas, so every shard is the mean over all N ranks. Memory per
rank is ZeRO's with N replaced by k (parameters, gradients and optimizer state are 1/k
of the model), the price of keeping the fabric for 2/k of the gradient bytes.

Ranks are grouped by index, as ``torchrun`` numbers them host by host:
shard groups ``{0..k-1}, {k..2k-1}, ...``, replicate groups ``{i, i+k, i+2k, ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ShardGroups", "check_shard_size", "hybrid_groups", "hybrid_layout"]


@dataclass(frozen=True)
class ShardGroups:
    """The ranks a unit is sharded over (``shard``) and those holding the same shard (``replicate``; None: no HSDP)."""

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None = None


def check_shard_size(shard_size: int, world_size: int) -> None:
    """A ValueError naming the divisors of ``world_size`` unless ``shard_size`` is one of them."""
    if shard_size < 1 or world_size % shard_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"shard_size={shard_size} does not divide the world size {world_size}; choose one of "
                         f"{divisors} (the ranks per host, for hybrid sharding)")


def hybrid_layout(world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups) of group ranks ``0..world_size-1`` with shards over ``shard_size`` ranks."""
    check_shard_size(shard_size, world_size)
    shards = [list(range(start, start + shard_size)) for start in range(0, world_size, shard_size)]
    replicas = [list(range(i, world_size, shard_size)) for i in range(shard_size)]
    return shards, replicas


def hybrid_groups(shard_size: int, group: dist.ProcessGroup | None = None) -> ShardGroups:
    """This rank's shard and replicate groups within ``group``; collective (every rank of ``group`` calls it).

    The replicate group is None when there is one shard group (plain ZeRO over ``group``).
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    shards, replicas = hybrid_layout(len(ranks), shard_size)
    me = dist.get_rank(group)
    mine_shard = mine_replica = None
    for members in shards:  # every rank creates every group, in the same order (torch requires it)
        made = dist.new_group([ranks[r] for r in members])
        if me in members:
            mine_shard = made
    if len(shards) == 1:
        return ShardGroups(mine_shard)
    for members in replicas:
        made = dist.new_group([ranks[r] for r in members])
        if me in members:
            mine_replica = made
    return ShardGroups(mine_shard, mine_replica)
