"""Ring algorithms: bandwidth-optimal, latency linear in the number of ranks.

The n ranks of a team sit on a ring; each round every rank sends one chunk to its right
neighbour and receives one from its left, so every link is busy in every round and no
rank sends more than its share (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009; the algorithm of Baidu's and
Horovod's all-reduce and of NCCL's ring):

- reduce-scatter: n-1 rounds; in round s rank i sends its partial sum of chunk
  i-s-1 and adds the incoming partial of chunk i-s-2 into its own. After the last
  round rank i holds chunk i summed over all ranks. Each rank sends (n-1)/n of the
  buffer.
- all-gather: n-1 rounds passing finished chunks on: rank i sends chunk i-s, receives
  chunk i-s-1 straight into place. (n-1)/n of the buffer again.
- all-reduce = reduce-scatter + all-gather: 2(n-1) rounds of size S/n, so each rank
  sends 2(n-1)/n x S, independent of n for large n; the price is 2(n-1) latencies,
  which is why small messages prefer the tree.
- broadcast: a pipelined chain from the root around the ring, in n chunks: 2n-2
  rounds, every rank but the last sends S once.

Chunks are the team's blocks: for an ordinary team, chunk i is rank i's shard
(:func:`~dptrain.comm.topology.shard_bounds`), so reduce-scatter leaves each rank its own
shard. A block may be several ranges (the shards of a whole node, in the hierarchical
algorithm); each range travels as its own message.
"""

from __future__ import annotations

import torch

from dptrain.comm.local import split, views
from dptrain.comm.topology import Range, Team, shard_bounds
from dptrain.comm.wire import Wire

__all__ = ["reduce_scatter", "all_gather", "all_reduce", "broadcast"]


def _size(block: list[Range]) -> int:
    return sum(b - a for a, b in block)


def reduce_scatter(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]]) -> None:
    """Sum flat ``x`` over the team, in place, into ``blocks[team.me]`` (the rest is scratch)."""
    n, me = team.size, team.me
    right, left = team.rank_of(me + 1), team.rank_of(me - 1)
    scratch = wire.scratch(max((_size(b) for b in blocks), default=0), x.dtype, x.device)
    for s in range(n - 1):
        send_block, recv_block = blocks[(me - s - 1) % n], blocks[(me - s - 2) % n]
        incoming = split(scratch, recv_block)
        wire.exchange(sends=[(right, v) for v in views(x, send_block)],
                      recvs=[(left, v) for v in incoming])
        for mine, theirs in zip(views(x, recv_block), incoming, strict=True):
            mine.add_(theirs)  # two operands: one rounding, as an fp32 sum would round


def all_gather(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]]) -> None:
    """Fill flat ``x`` with every member's block, given that ``blocks[team.me]`` is in place."""
    n, me = team.size, team.me
    right, left = team.rank_of(me + 1), team.rank_of(me - 1)
    for s in range(n - 1):
        wire.exchange(sends=[(right, v) for v in views(x, blocks[(me - s) % n])],
                      recvs=[(left, v) for v in views(x, blocks[(me - s - 1) % n])])


def all_reduce(wire: Wire, team: Team, x: torch.Tensor) -> None:
    """Sum flat ``x`` over the team in place: reduce-scatter, then all-gather."""
    blocks = [[r] for r in shard_bounds(x.numel(), team.size)]
    reduce_scatter(wire, team, x, blocks)
    all_gather(wire, team, x, blocks)


def broadcast(wire: Wire, team: Team, x: torch.Tensor, root: int) -> None:
    """Copy flat ``x`` from team index ``root`` to all: a chain around the ring, n chunks deep."""
    n = team.size
    p = (team.me - root) % n  # position in the chain
    chunks = shard_bounds(x.numel(), n)
    right, left = team.rank_of(team.me + 1), team.rank_of(team.me - 1)
    for t in range(2 * n - 2):
        send, recv = t - p, t - p + 1  # chunk indices sent right / received from the left
        sends = [(right, x[slice(*chunks[send])])] if p < n - 1 and 0 <= send < n else []
        recvs = [(left, x[slice(*chunks[recv])])] if p > 0 and 0 <= recv < n else []
        wire.exchange(sends, recvs)

