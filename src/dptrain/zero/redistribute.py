"""Between ZeRO's flat shards and DTensor's ``Shard(0)`` chunks: one all-to-all per tensor.

ZeRO cuts a unit's flat buffer (its parameters, flattened and concatenated) into
contiguous ranges of ``ceil`` or ``floor(numel / N)`` elements (:func:`~dptrain.comm.
topology.shard_range`), wherever a parameter happens to be. A DTensor with placement
``Shard(0)`` splits each parameter along its first dimension the way ``torch.chunk``
does: ``ceil(rows / N)`` rows per rank, the last ranks possibly short or empty. Both are,
per rank, a sorted list of intervals of the unit's flat coordinates (a row chunk of a
row-major parameter is contiguous), so moving from one to the other is an
*interval exchange*: rank s sends rank d the intersection of what s holds in the
source layout with what d needs in the target layout, in flat order, with one
``all_to_all_single`` of uneven splits over the shard group.

What it costs: each element moves at most once, and only where the two cuts disagree:
a rank keeps the part of its ZeRO range that falls inside its own chunks. Measured in
``docs/zero.md`` (Checkpoints).

A 0-dim parameter cannot be split by rows: it is ``Replicate()``, every rank needs it
(as a target) and rank 0 alone sends it (as a source), so each element is sent once.

The layout arithmetic (:func:`zero_intervals`, :func:`chunk_intervals`,
:func:`transfers`) needs no process group and is tested on its own.
"""

from __future__ import annotations

import bisect
import math

import torch
import torch.distributed as dist

from dptrain import comm

__all__ = ["Interval", "chunk_rows", "zero_intervals", "chunk_intervals", "transfers", "redistribute"]

Interval = tuple[int, int]  # [lo, hi) in a unit's flat coordinates


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[first, last)`` rows of ``rank``'s chunk under ``Shard(0)``: ``torch.chunk``'s split of ``rows``."""
    size = math.ceil(rows / world_size) if rows else 0
    return min(rank * size, rows), min((rank + 1) * size, rows)


def zero_intervals(numel: int, world_size: int) -> list[list[Interval]]:
    """Per rank, ZeRO's shard of a ``numel``-element unit: one interval each."""
    return [[comm.shard_range(numel, world_size, r)] for r in range(world_size)]


def chunk_intervals(shapes: list[torch.Size], world_size: int, sending: bool = False) -> list[list[Interval]]:
    """Per rank, its ``Shard(0)`` chunk of each parameter of a unit (``shapes`` in the unit's order), in flat order.

    A 0-dim parameter is replicated: every rank holds it, and with ``sending`` only rank 0
    (so that each element has one sender). Empty chunks are left out.
    """
    out: list[list[Interval]] = [[] for _ in range(world_size)]
    start = 0
    for shape in shapes:
        numel = shape.numel()
        if len(shape) == 0:
            for r in range(1 if sending else world_size):
                out[r].append((start, start + 1))
        elif numel:
            per_row = numel // shape[0]
            for r in range(world_size):
                first, last = chunk_rows(shape[0], world_size, r)
                if last > first:
                    out[r].append((start + first * per_row, start + last * per_row))
        start += numel
    return out


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The non-empty intersections of two sorted lists of disjoint intervals, sorted."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def transfers(source: list[list[Interval]], target: list[list[Interval]],
              rank: int) -> tuple[list[list[Interval]], list[list[Interval]]]:
    """(what ``rank`` sends each rank, what it receives from each rank): flat intervals in order.

    Rank s's ``sends[d]`` equals rank d's ``receives[s]``: both are ``source[s] & target[d]``.
    """
    world_size = len(source)
    sends = [_intersect(source[rank], target[d]) for d in range(world_size)]
    receives = [_intersect(source[s], target[rank]) for s in range(world_size)]
    return sends, receives


class _Local:
    """A rank's 1-D buffer holding its intervals back to back: flat position -> buffer position."""

    def __init__(self, intervals: list[Interval]):
        self.starts = [lo for lo, _ in intervals]
        self.ends = [hi for _, hi in intervals]
        self.at = [0]
        for lo, hi in intervals:
            self.at.append(self.at[-1] + hi - lo)

    @property
    def numel(self) -> int:
        return self.at[-1]

    def position(self, flat: int) -> int:
        i = bisect.bisect_right(self.starts, flat) - 1
        if i < 0 or flat >= self.ends[i]:
            held = list(zip(self.starts, self.ends, strict=True))
            raise AssertionError(f"flat position {flat} is not held here ({held})")
        return self.at[i] + flat - self.starts[i]


def redistribute(local: torch.Tensor, source: list[list[Interval]], target: list[list[Interval]],
                 group: dist.ProcessGroup | None, held: list[Interval] | None = None) -> torch.Tensor:
    """Collective over ``group``: this rank's elements of the ``target`` layout, from its ``source`` ones.

    ``local`` holds this rank's ``held`` intervals back to back (default: its ``source``
    ones; more when replicated elements are held but sent by another rank): a ZeRO
    shard, or the concatenated chunks of a unit's parameters. The result holds its
    ``target`` intervals back to back.
    """
    world_size = len(source)
    rank = dist.get_rank(group) if world_size > 1 else 0
    sends, receives = transfers(source, target, rank)
    have, want = _Local(source[rank] if held is None else held), _Local(target[rank])
    if local.numel() != have.numel:
        raise AssertionError(f"local buffer of {local.numel()} elements, the layout gives this rank {have.numel}")
    pieces = [local[have.position(lo):have.position(lo) + hi - lo] for per_rank in sends for lo, hi in per_rank]
    outgoing = torch.cat(pieces) if pieces else local.new_empty(0)
    if world_size > 1:
        incoming = local.new_empty(sum(hi - lo for per_rank in receives for lo, hi in per_rank))
        dist.all_to_all_single(incoming, outgoing, [sum(h - lo for lo, h in r) for r in receives],
                               [sum(h - lo for lo, h in s) for s in sends], group=group)
    else:
        incoming = outgoing
    out = local.new_empty(want.numel)
    at = 0
    for per_rank in receives:
        for lo, hi in per_rank:
            out[want.position(lo):want.position(lo) + hi - lo] = incoming[at:at + hi - lo]
            at += hi - lo
    return out
