"""Who talks to whom: shard layouts, ring neighbours, binomial trees and node groups.

Pure functions with no process group, shared by the algorithms (which send along these
shapes) and by the cost model (which counts what they send). Ranks here are *group*
ranks, 0..world_size-1; a :class:`Team` is an ordered subset of them (a node, or the
node leaders) that an algorithm runs over.

A tensor of ``numel`` elements is split into ``world_size`` contiguous shards in the
``numpy.array_split`` layout: the first ``numel % world_size`` shards hold one element
more. Any length works, 0 and lengths shorter than the world size included (some
shards are then empty). ``reduce_scatter`` leaves shard ``r`` on rank ``r`` and
``all_gather`` takes it from there; the ring algorithm uses the same shards as chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Range", "shard_bounds", "shard_range", "Team", "binomial_parent", "binomial_children",
           "binomial_subtree", "binomial_rounds", "node_groups", "merge_ranges"]

Range = tuple[int, int]  # [start, stop) in elements of the flat tensor


def shard_bounds(numel: int, world_size: int) -> list[Range]:
    """The ``world_size`` contiguous shards of ``numel`` elements (array_split layout)."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        stop = start + base + (r < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_range(numel: int, world_size: int, rank: int) -> Range:
    """Rank ``rank``'s shard of a ``numel``-element tensor: ``shard_bounds(...)[rank]``."""
    base, extra = divmod(numel, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class Team:
    """An ordered set of group ranks running one algorithm; ``me`` is this rank's index in it.

    ``ranks[0]`` is the root of tree algorithms (the node leader, for a node team).
    """

    ranks: tuple[int, ...]
    me: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, index: int) -> int:
        return self.ranks[index % len(self.ranks)]

    @classmethod
    def of(cls, ranks: Sequence[int], my_rank: int) -> Team:
        ranks = tuple(ranks)
        return cls(ranks, ranks.index(my_rank))


# --------------------------------------------------------------------- binomial tree
#
# Rooted at index 0 of a team of n: node v's parent clears v's lowest set bit; v's
# children are v + 2^k for every 2^k below that bit (all k for the root) with
# v + 2^k < n. Node v's subtree is the contiguous index range [v, v + lowbit(v)) clipped
# to n, so a reduction up the tree takes ceil(log2 n) rounds, and a scatter can send each
# child one contiguous slice. A tree rooted elsewhere relabels: v = (index - root) % n.


def _lowbit(v: int, n: int) -> int:
    return v & -v if v else 1 << max(n - 1, 0).bit_length()


def binomial_parent(v: int) -> int | None:
    """Index of ``v``'s parent in the binomial tree rooted at 0 (None for the root)."""
    return v & (v - 1) if v else None


def binomial_children(v: int, n: int) -> list[int]:
    """``v``'s children, nearest first (the order a reduction receives them in)."""
    children, k = [], 1
    while k < _lowbit(v, n) and v + k < n:
        children.append(v + k)
        k <<= 1
    return children


def binomial_subtree(v: int, n: int) -> Range:
    """The contiguous index range of ``v``'s subtree (itself included)."""
    return v, min(v + _lowbit(v, n), n)


def binomial_rounds(n: int) -> int:
    """Rounds of a binomial reduction or broadcast over n: ceil(log2 n)."""
    return max(n - 1, 0).bit_length()


# ---------------------------------------------------------------------- node groups


def node_groups(world_size: int, nodes: int | Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The group's ranks split into nodes, each listed leader first.

    ``nodes`` is ranks per node (the local world size: ranks 0..k-1 form node 0, and
    so on, as torchrun numbers them) or an explicit grouping, a partition of
    ``range(world_size)`` whose first rank in each list is the node's leader.
    """
    if isinstance(nodes, int):
        if nodes < 1 or world_size % nodes:
            raise ValueError(f"nodes={nodes} ranks per node does not divide world size {world_size}; "
                             f"pass a divisor of {world_size} or an explicit grouping")
        return [tuple(range(s, s + nodes)) for s in range(0, world_size, nodes)]
    groups = [tuple(int(r) for r in g) for g in nodes]
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)) or any(not g for g in groups):
        raise ValueError(f"nodes={groups!r} must partition ranks 0..{world_size - 1} into non-empty "
                         "groups (every rank exactly once)")
    return groups


def merge_ranges(ranges: Sequence[Range]) -> list[Range]:
    """``ranges`` with empty ones dropped and touching neighbours joined (fewer messages)."""
    out: list[Range] = []
    for a, b in ranges:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
