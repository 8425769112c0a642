"""The α-β cost model of every collective algorithm: rounds, bytes per rank, predicted time.

A collective runs in rounds; in each round every rank sends and receives at most a few
messages. The α-β(-γ) model (Hockney 1994; Thakur, Rabenseifner & Gropp 2005) charges
a round

    α + m / β + r γ

where α is the per-message latency (seconds), β the link bandwidth (bytes/second), m
the bytes the busiest rank moves in that round, and r the bytes it adds locally (γ
seconds per byte; 0 unless fitted). What "moves" means depends on the link:

- **full duplex** (a NIC, NVLink): sending and receiving at once cost no more than
  either, so m is the larger of the busiest rank's sent and received bytes;
- **half duplex** (a shared resource, e.g. loopback TCP, where the kernel copies both
  directions with the same CPU and memory bus): m is the busiest rank's sent *plus*
  received bytes, so a ring round, where every rank sends and receives a chunk, costs
  twice a tree round, where each rank does one or the other.

``dptrain bench comm`` fits both and keeps the one that explains the measurements.
A collective's time is the sum over its rounds, so for n ranks and S bytes on a full
duplex link:

    ============  =====================  ============  =============================
    algorithm     all-reduce rounds      bytes / rank  predicted (γ = 0)
    ============  =====================  ============  =============================
    ring          2(n-1)                 2(n-1)/n S    2(n-1) α + 2(n-1)/n S/β
    tree          2 ceil(log2 n)         <= log2 n S   2 ceil(log2 n) (α + S/β)
    naive         1                      (n-1) S       α + (n-1) S/β
    hierarchical  per tier: tree in the node, ring across k node leaders
    ============  =====================  ============  =============================

This module is the single source of truth for those numbers: the tests check that
the bytes each rank actually sends (:class:`~dptrain.comm.wire.Traffic`) equal
:attr:`Cost.bytes_sent` exactly, ``dptrain bench comm`` prints its predictions beside
measured times, and the planner reuses it. Shapes (shards, trees, node groups) come
from :mod:`dptrain.comm.topology`, the same functions the algorithms run on.

Tiers: flat algorithms run on one tier, ``"net"``; the hierarchical one charges its
intra-node rounds to ``"node"`` and its leader rounds to ``"net"``. ``native`` is
predicted as ``ring`` (gloo's and NCCL's large-message algorithm).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dptrain.comm.topology import (
    binomial_children,
    binomial_rounds,
    binomial_subtree,
    node_groups,
    shard_bounds,
)

__all__ = ["Link", "Round", "Cost", "collective_cost", "busbw_factor"]


@dataclass(frozen=True)
class Round:
    """One round on the critical path, as seen by its busiest rank.

    ``nbytes``: the most any rank sends or receives (the full-duplex load); ``moved``:
    the most any rank sends plus receives (the half-duplex load; ``nbytes`` if omitted,
    i.e. every rank only sends or only receives); ``reduced``: the most any rank adds.
    """

    tier: str
    nbytes: int
    reduced: int = 0
    moved: int = -1

    def __post_init__(self):
        if self.moved < 0:
            object.__setattr__(self, "moved", self.nbytes)


@dataclass(frozen=True)
class Link:
    """One tier: latency ``alpha`` (s), bandwidth ``beta`` (B/s), reduction ``gamma`` (s/B), duplex or not."""

    alpha: float
    beta: float
    gamma: float = 0.0
    duplex: bool = True

    def time(self, r: Round) -> float:
        return self.alpha + (r.nbytes if self.duplex else r.moved) / self.beta + r.reduced * self.gamma


@dataclass(frozen=True)
class Cost:
    """What one collective costs: its rounds and the exact bytes each rank sends."""

    collective: str
    algorithm: str
    world_size: int
    nbytes: int
    rounds: tuple[Round, ...]
    bytes_sent: tuple[int, ...]

    def steps(self, tier: str | None = None) -> int:
        return sum(1 for r in self.rounds if tier is None or r.tier == tier)

    def predict(self, links: Link | Mapping[str, Link]) -> float:
        """Predicted seconds: the sum of the rounds' α + m/β + rγ, each with its tier's link."""
        if isinstance(links, Link):
            return sum(links.time(r) for r in self.rounds)
        return sum(links[r.tier].time(r) for r in self.rounds)

    def load(self, duplex: bool = True) -> int:
        """Bytes on the critical path: the sum over rounds of the busiest rank's load."""
        return sum(r.nbytes if duplex else r.moved for r in self.rounds)


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor (a rank's share of the traffic)."""
    n = world_size
    if n == 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_gather": (n - 1) / n, "broadcast": 1.0}[collective]


def collective_cost(collective: str, algorithm: str, numel: int, itemsize: int, world_size: int, *,
                    nodes: int | Sequence[Sequence[int]] | None = None, src: int = 0) -> Cost:
    """The cost of ``collective`` with ``algorithm`` on a ``numel``-element tensor over ``world_size`` ranks.

    For reduce-scatter / all-gather ``numel`` is the full (unsharded) length.
    """
    shards = _chunks(numel, itemsize, world_size)
    n, size = world_size, numel * itemsize
    if n == 1 or numel == 0:
        return Cost(collective, algorithm, n, size, (), (0,) * n)
    if algorithm == "hierarchical":
        if nodes is None:
            raise ValueError("the hierarchical cost needs nodes= (ranks per node or a grouping)")
        plan = _hierarchical(collective, node_groups(n, nodes), shards, numel, itemsize, src)
    else:
        flat = {"ring": _Ring, "native": _Ring, "tree": _Tree, "naive": _Naive}[algorithm]
        plan = flat(list(range(n)), "net").run(collective, shards, src)
    sent = [0] * n
    for rank, nbytes in plan.sent.items():
        sent[rank] += nbytes
    return Cost(collective, algorithm, n, size, tuple(r for r in plan.rounds if r.nbytes), tuple(sent))


# --------------------------------------------------------------------- per-team plans


class _Plan:
    """Rounds and bytes sent, accumulated over the phases of a collective."""

    def __init__(self):
        self.rounds: list[Round] = []
        self.sent: dict[int, int] = {}

    def send(self, rank: int, nbytes: int) -> None:
        self.sent[rank] = self.sent.get(rank, 0) + nbytes

    def extend(self, other: _Plan) -> _Plan:
        self.rounds += other.rounds
        for rank, nbytes in other.sent.items():
            self.send(rank, nbytes)
        return self


class _Team:
    """A team of group ranks on one tier; ``blocks`` are byte sizes per member."""

    def __init__(self, ranks: list[int], tier: str):
        self.ranks, self.tier, self.n = ranks, tier, len(ranks)

    def run(self, collective: str, shards: list[int], src: int) -> _Plan:
        """The whole group as one team: ``shards`` are its members' shard sizes in bytes."""
        if collective == "all_reduce":
            return self.all_reduce(shards)
        if collective == "reduce_scatter":
            return self.reduce_scatter(shards)
        if collective == "all_gather":
            return self.all_gather(shards)
        return self.broadcast(shards, self.ranks.index(src))


class _Ring(_Team):
    """In every round each rank sends block j and receives block j-1 for some j (see ring.py)."""

    def _pairs(self, blocks: list[int]) -> int:
        return max(blocks[i] + blocks[i - 1] for i in range(self.n))

    def reduce_scatter(self, blocks: list[int]) -> _Plan:
        plan, total = _Plan(), sum(blocks)
        for i, rank in enumerate(self.ranks):
            plan.send(rank, total - blocks[i])
        plan.rounds = [Round(self.tier, max(blocks), max(blocks), self._pairs(blocks))] * (self.n - 1)
        return plan

    def all_gather(self, blocks: list[int]) -> _Plan:
        plan, total = _Plan(), sum(blocks)
        for i, rank in enumerate(self.ranks):
            plan.send(rank, total - blocks[(i + 1) % self.n])
        plan.rounds = [Round(self.tier, max(blocks), 0, self._pairs(blocks))] * (self.n - 1)
        return plan

    def all_reduce(self, chunks: list[int]) -> _Plan:
        return self.reduce_scatter(chunks).extend(self.all_gather(chunks))

    def broadcast(self, chunks: list[int], root: int) -> _Plan:
        plan, size = _Plan(), sum(chunks)
        for i, rank in enumerate(self.ranks):
            plan.send(rank, size if (i - root) % self.n < self.n - 1 else 0)
        # Inner ranks of the chain forward one chunk while receiving the next; with two
        # ranks, one only sends and the other only receives.
        moved = self._pairs(chunks) if self.n > 2 else max(chunks)
        plan.rounds = [Round(self.tier, max(chunks), 0, moved)] * (2 * self.n - 2)
        return plan


class _Tree(_Team):
    """Binomial tree rooted at team index ``root``; message sizes are given per child label.

    In each round of a binomial tree a rank either sends or receives, never both, so a
    round's half-duplex load equals its full-duplex one.
    """

    def _subtree_bytes(self, label: int, blocks: list[int], root: int) -> int:
        lo, hi = binomial_subtree(label, self.n)
        return sum(blocks[(i + root) % self.n] for i in range(lo, hi))

    def up(self, message: callable, root: int = 0, reduce: bool = False) -> _Plan:
        """Each non-root label sends ``message(label)`` to its parent; round k holds lowbit 2^k."""
        plan, rounds = _Plan(), binomial_rounds(self.n)
        by_round = [0] * rounds
        for v in range(1, self.n):
            k = (v & -v).bit_length() - 1
            by_round[k] = max(by_round[k], message(v))
            plan.send(self.ranks[(v + root) % self.n], message(v))
        plan.rounds = [Round(self.tier, m, m if reduce else 0) for m in by_round]
        return plan

    def down(self, message: callable, root: int = 0) -> _Plan:
        """Each label sends ``message(child)`` to each child, farthest child (largest 2^k) first."""
        plan, rounds = _Plan(), binomial_rounds(self.n)
        by_round = [0] * rounds
        for v in range(self.n):
            for c in binomial_children(v, self.n):
                k = (c - v).bit_length() - 1
                by_round[rounds - 1 - k] = max(by_round[rounds - 1 - k], message(c))
                plan.send(self.ranks[(v + root) % self.n], message(c))
        plan.rounds = [Round(self.tier, m) for m in by_round]
        return plan

    def all_reduce(self, chunks: list[int]) -> _Plan:
        size = sum(chunks)
        return self.up(lambda v: size, reduce=True).extend(self.down(lambda c: size))

    def reduce_scatter(self, blocks: list[int]) -> _Plan:
        size = sum(blocks)
        return self.up(lambda v: size, reduce=True).extend(
            self.down(lambda c: self._subtree_bytes(c, blocks, 0)))

    def all_gather(self, blocks: list[int]) -> _Plan:
        size = sum(blocks)
        return self.up(lambda v: self._subtree_bytes(v, blocks, 0)).extend(self.down(lambda c: size))

    def broadcast(self, chunks: list[int], root: int) -> _Plan:
        size = sum(chunks)
        return self.down(lambda c: size, root)


class _Naive(_Team):
    def _one_round(self, sends: list[int], recvs: list[int], reduced: int = 0) -> _Plan:
        plan = _Plan()
        for rank, nbytes in zip(self.ranks, sends, strict=True):
            plan.send(rank, nbytes)
        moved = max(s + r for s, r in zip(sends, recvs, strict=True))
        plan.rounds = [Round(self.tier, max(max(sends), max(recvs)), reduced, moved)]
        return plan

    def all_reduce(self, chunks: list[int]) -> _Plan:
        each = (self.n - 1) * sum(chunks)
        return self._one_round([each] * self.n, [each] * self.n, each)

    def reduce_scatter(self, blocks: list[int]) -> _Plan:
        total = sum(blocks)
        return self._one_round([total - b for b in blocks], [(self.n - 1) * b for b in blocks],
                               (self.n - 1) * max(blocks))

    def all_gather(self, blocks: list[int]) -> _Plan:
        total = sum(blocks)
        return self._one_round([(self.n - 1) * b for b in blocks], [total - b for b in blocks])

    def broadcast(self, chunks: list[int], root: int) -> _Plan:
        size = sum(chunks)
        return self._one_round([(self.n - 1) * size if i == root else 0 for i in range(self.n)],
                               [0 if i == root else size for i in range(self.n)])


def _chunks(numel: int, itemsize: int, n: int) -> list[int]:
    """Bytes of each of the n shards of a tensor (whole elements, as the algorithms split it)."""
    return [(b - a) * itemsize for a, b in shard_bounds(numel, n)]


# --------------------------------------------------------------------- hierarchical


def _hierarchical(collective: str, nodes: list[tuple[int, ...]], shards: list[int], numel: int,
                  itemsize: int, src: int) -> _Plan:
    """Tree inside every node (tier "node"), ring across leaders (tier "net"), tree back.

    Nodes run their intra-node phases in parallel, so a phase's round costs the maximum
    over nodes; rounds are aligned by index.
    """
    local = [_Tree(list(g), "node") for g in nodes]
    leaders = _Ring([g[0] for g in nodes], "net")
    node_bytes = [sum(shards[r] for r in g) for g in nodes]
    member = [[shards[r] for r in g] for g in nodes]
    size = numel * itemsize
    if collective == "all_reduce":
        phases = [[t.up(lambda v: size, reduce=True) for t in local], [leaders.all_reduce(_chunks(numel, itemsize, leaders.n))],
                  [t.down(lambda c: size) for t in local]]
    elif collective == "reduce_scatter":
        phases = [[t.up(lambda v: size, reduce=True) for t in local], [leaders.reduce_scatter(node_bytes)],
                  [t.down(lambda c, t=t, b=b: t._subtree_bytes(c, b, 0)) for t, b in zip(local, member, strict=True)]]
    elif collective == "all_gather":
        phases = [[t.up(lambda v, t=t, b=b: t._subtree_bytes(v, b, 0)) for t, b in zip(local, member, strict=True)],
                  [leaders.all_gather(node_bytes)], [t.down(lambda c: size) for t in local]]
    else:
        home = next(i for i, g in enumerate(nodes) if src in g)
        phases = [[local[home].down(lambda c: size, nodes[home].index(src))],
                  [_Tree(leaders.ranks, "net").down(lambda c: size, home)],
                  [t.down(lambda c: size) for i, t in enumerate(local) if i != home]]
    plan = _Plan()
    for phase in phases:
        plan.extend(_parallel(phase))
    return plan


def _parallel(plans: list[_Plan]) -> _Plan:
    """Plans that run at the same time on disjoint ranks: round i costs the max over them."""
    out = _Plan()
    for p in plans:
        for rank, nbytes in p.sent.items():
            out.send(rank, nbytes)
    depth = max((len(p.rounds) for p in plans), default=0)
    for i in range(depth):
        here = [p.rounds[i] for p in plans if i < len(p.rounds)]
        out.rounds.append(Round(here[0].tier, max(r.nbytes for r in here), max(r.reduced for r in here),
                                max(r.moved for r in here)))
    return out
