"""Hierarchical algorithms: reduce inside each node, all-reduce across nodes, broadcast back.

Links inside a machine (shared memory, NVLink) are far faster than the network between
machines, so the hierarchical all-reduce sends across the network only once per node,
not once per rank (the two-level scheme of Horovod's hierarchical all-reduce and of
Jia et al., "Highly scalable deep learning training system with mixed-precision",
2018):

1. intra-node: a binomial-tree reduce of the whole buffer to the node's leader;
2. inter-node: a ring all-reduce among the leaders (one rank per node on the network);
3. intra-node: a binomial-tree broadcast from the leader.

Reduce-scatter and all-gather follow the same plan with the ring's reduce-scatter /
all-gather in the middle, a node's block being its members' shards, and a tree scatter
/ gather inside the node. Broadcast runs the tree inside the root's node, across the
leaders, then inside the other nodes. Each tier has its own cost (α, β) in
:mod:`dptrain.comm.cost`. Nodes are lists of group ranks, leader first
(:func:`~dptrain.comm.topology.node_groups`).
"""

from __future__ import annotations

import torch

from dptrain.comm import ring, tree
from dptrain.comm.topology import Range, Team, merge_ranges
from dptrain.comm.wire import Wire

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]


class _Levels:
    """This rank's node team and, on a leader, the team of leaders."""

    def __init__(self, nodes: list[tuple[int, ...]], rank: int):
        self.nodes = nodes
        self.node = next(g for g in nodes if rank in g)
        self.local = Team.of(self.node, rank)
        self.leaders = Team.of([g[0] for g in nodes], rank) if self.node[0] == rank else None

    def node_blocks(self, shards: list[Range]) -> list[list[Range]]:
        return [merge_ranges([shards[r] for r in g]) for g in self.nodes]

    def member_blocks(self, shards: list[Range]) -> list[list[Range]]:
        return [merge_ranges([shards[r]]) for r in self.node]


def all_reduce(wire: Wire, nodes: list[tuple[int, ...]], rank: int, x: torch.Tensor) -> None:
    lv = _Levels(nodes, rank)
    tree.reduce(wire, lv.local, x)
    if lv.leaders is not None:
        ring.all_reduce(wire, lv.leaders, x)
    tree.broadcast(wire, lv.local, x)


def reduce_scatter(wire: Wire, nodes: list[tuple[int, ...]], rank: int, x: torch.Tensor,
                   shards: list[Range]) -> None:
    lv = _Levels(nodes, rank)
    tree.reduce(wire, lv.local, x)
    if lv.leaders is not None:
        ring.reduce_scatter(wire, lv.leaders, x, lv.node_blocks(shards))
    tree.scatter(wire, lv.local, x, lv.member_blocks(shards))


def all_gather(wire: Wire, nodes: list[tuple[int, ...]], rank: int, x: torch.Tensor,
               shards: list[Range]) -> None:
    lv = _Levels(nodes, rank)
    tree.gather(wire, lv.local, x, lv.member_blocks(shards))
    if lv.leaders is not None:
        ring.all_gather(wire, lv.leaders, x, lv.node_blocks(shards))
    tree.broadcast(wire, lv.local, x)


def broadcast(wire: Wire, nodes: list[tuple[int, ...]], rank: int, x: torch.Tensor, src: int) -> None:
    lv = _Levels(nodes, rank)
    src_node = next(i for i, g in enumerate(nodes) if src in g)
    if src in lv.node:
        tree.broadcast(wire, lv.local, x, root=lv.node.index(src))
    if lv.leaders is not None:
        tree.broadcast(wire, lv.leaders, x, root=src_node)
    if src not in lv.node:
        tree.broadcast(wire, lv.local, x)
