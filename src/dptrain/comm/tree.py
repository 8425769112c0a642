"""Binomial-tree algorithms: ceil(log2 n) rounds per phase, full-size messages.

A reduction climbs a binomial tree rooted at team index ``root`` and a broadcast
descends it (:mod:`dptrain.comm.topology` for its shape). Each phase takes
ceil(log2 n) rounds, against the ring's n-1, so the tree wins when latency dominates
(small messages, many ranks). The price is bandwidth: every message carries the whole
buffer and the root sends it ceil(log2 n) times, the contention near the root that
keeps trees out of large all-reduces (Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005, binomial reduce/bcast).

- all-reduce: reduce to the root, then broadcast: 2 ceil(log2 n) rounds.
- reduce-scatter: reduce to the root, then scatter down the tree: each node passes a
  child only the blocks of that child's subtree (a contiguous run of members).
- all-gather: gather up the tree (each node forwards its subtree's blocks), then
  broadcast the whole buffer.

A node that receives from several children sums them in fp32 when the tensor is
fp16/bf16 (:mod:`dptrain.comm.local`), rounding once.
"""

from __future__ import annotations

import torch

from dptrain.comm.local import accumulator, finish, views
from dptrain.comm.topology import Range, Team, binomial_children, binomial_parent, binomial_subtree
from dptrain.comm.wire import Wire

__all__ = ["reduce", "broadcast", "scatter", "gather", "all_reduce", "reduce_scatter", "all_gather"]


class _Tree:
    """The binomial tree over ``team`` rooted at index ``root``, seen from this rank."""

    def __init__(self, team: Team, root: int):
        self.team, self.root, self.n = team, root, team.size
        self.v = (team.me - root) % self.n  # this rank's label (the root is 0)

    def rank(self, label: int) -> int:
        return self.team.rank_of(label + self.root)

    def parent(self) -> int | None:
        p = binomial_parent(self.v)
        return None if p is None else self.rank(p)

    def children(self) -> list[int]:
        """Child labels, nearest first."""
        return binomial_children(self.v, self.n)

    def ranges(self, label: int, blocks: list[list[Range]]) -> list[Range]:
        """The blocks of ``label``'s subtree, in member order."""
        lo, hi = binomial_subtree(label, self.n)
        return [r for i in range(lo, hi) for r in blocks[(i + self.root) % self.n]]


def reduce(wire: Wire, team: Team, x: torch.Tensor, root: int = 0) -> None:
    """Sum flat ``x`` over the team into the root's ``x`` (other ranks' ``x`` becomes scratch)."""
    tree = _Tree(team, root)
    children = tree.children()
    if children:
        acc, incoming = accumulator(x, wire), wire.scratch(x.numel(), x.dtype, x.device)
        for child in children:
            wire.exchange(recvs=[(tree.rank(child), incoming)])
            acc.add_(incoming)
        finish(acc, x)
    parent = tree.parent()
    if parent is not None:
        wire.exchange(sends=[(parent, x)])


def broadcast(wire: Wire, team: Team, x: torch.Tensor, root: int = 0) -> None:
    """Copy flat ``x`` from team index ``root`` to every member, farthest child first."""
    tree = _Tree(team, root)
    parent = tree.parent()
    if parent is not None:
        wire.exchange(recvs=[(parent, x)])
    for child in reversed(tree.children()):
        wire.exchange(sends=[(tree.rank(child), x)])


def scatter(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]], root: int = 0) -> None:
    """From the root's ``x``, deliver each member its ``blocks[member]`` (and its subtree's)."""
    tree = _Tree(team, root)
    parent = tree.parent()
    if parent is not None:
        wire.exchange(recvs=[(parent, v) for v in views(x, tree.ranges(tree.v, blocks))])
    for child in reversed(tree.children()):
        wire.exchange(sends=[(tree.rank(child), v) for v in views(x, tree.ranges(child, blocks))])


def gather(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]], root: int = 0) -> None:
    """Collect every member's ``blocks[member]`` of ``x`` at the root."""
    tree = _Tree(team, root)
    for child in tree.children():
        wire.exchange(recvs=[(tree.rank(child), v) for v in views(x, tree.ranges(child, blocks))])
    parent = tree.parent()
    if parent is not None:
        wire.exchange(sends=[(parent, v) for v in views(x, tree.ranges(tree.v, blocks))])


def all_reduce(wire: Wire, team: Team, x: torch.Tensor) -> None:
    reduce(wire, team, x)
    broadcast(wire, team, x)


def reduce_scatter(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]]) -> None:
    reduce(wire, team, x)
    scatter(wire, team, x, blocks)


def all_gather(wire: Wire, team: Team, x: torch.Tensor, blocks: list[list[Range]]) -> None:
    gather(wire, team, x, blocks)
    broadcast(wire, team, x)
