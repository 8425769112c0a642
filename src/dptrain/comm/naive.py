"""Naive algorithms: everyone sends everything straight to everyone, then reduces locally.

The textbook baseline and the tests' oracle: one round, but each rank sends (n-1) x S
for an all-reduce (the all-gather + local mean of the data-parallel seeds), n-1 times
what the ring sends for large n. Sums run over members in team order, in fp32 for
fp16/bf16, so every rank computes the bit-identical result.
"""

from __future__ import annotations

import torch

from dptrain.comm.local import accumulator, finish, split, views
from dptrain.comm.topology import Range, Team
from dptrain.comm.wire import Wire

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]


def _peers(team: Team) -> list[int]:
    return [i for i in range(team.size) if i != team.me]


def _incoming(wire: Wire, team: Team, numel: int, like: torch.Tensor) -> dict[int, torch.Tensor]:
    """One receive buffer of ``numel`` per peer, carved from one scratch buffer."""
    peers = _peers(team)
    flat = wire.scratch(numel * len(peers), like.dtype, like.device)
    return {i: flat[k * numel:(k + 1) * numel] for k, i in enumerate(peers)}


def _sum_in_order(wire: Wire, x: torch.Tensor, mine: int, incoming: dict[int, torch.Tensor], n: int) -> None:
    """``x`` = sum over members 0..n-1 of their contribution (``x`` itself for ``mine``)."""
    parts = [x if i == mine else incoming[i] for i in range(n)]
    acc = accumulator(parts[0], wire)  # x itself for fp32 when x comes first: summed in place
    for part in parts[1:]:
        acc.add_(part)
    finish(acc, x)


def all_reduce(wire: Wire, team: Team, x: torch.Tensor) -> None:
    incoming = _incoming(wire, team, x.numel(), x)
    wire.exchange(sends=[(team.rank_of(i), x) for i in incoming],
                  recvs=[(team.rank_of(i), t) for i, t in incoming.items()])
    _sum_in_order(wire, x, team.me, incoming, team.size)


def reduce_scatter(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]]) -> None:
    mine = blocks[team.me]
    own = torch.cat(views(x, mine)) if len(mine) != 1 else x[slice(*mine[0])]
    incoming = _incoming(wire, team, own.numel(), x)
    sends = [(team.rank_of(i), v) for i in incoming for v in views(x, blocks[i])]
    recvs = [(team.rank_of(i), v) for i, t in incoming.items() for v in split(t, mine)]
    wire.exchange(sends, recvs)
    _sum_in_order(wire, own, team.me, incoming, team.size)
    if len(mine) != 1:
        for v, part in zip(views(x, mine), split(own, mine), strict=True):
            v.copy_(part)


def all_gather(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]]) -> None:
    peers = _peers(team)
    wire.exchange(sends=[(team.rank_of(i), v) for i in peers for v in views(x, blocks[team.me])],
                  recvs=[(team.rank_of(i), v) for i in peers for v in views(x, blocks[i])])


def broadcast(wire: Wire, team: Team, x: torch.Tensor, root: int) -> None:
    if team.me == root:
        wire.exchange(sends=[(team.rank_of(i), x) for i in range(team.size) if i != root])
    else:
        wire.exchange(recvs=[(team.rank_of(root), x)])

