"""The cost model: pure formulas, and the bytes each rank really sends checked against it exactly."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from dptrain import comm
from dptrain.comm.cost import Link, busbw_factor, collective_cost
from dptrain.comm.topology import binomial_children, binomial_parent, binomial_subtree, node_groups
from dptrain.testing import run_on_ranks

OURS = ("ring", "tree", "naive", "hierarchical")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


# --------------------------------------------------------------------- pure


@pytest.mark.parametrize("numel,world_size", [(0, 3), (1, 4), (10, 3), (12, 4), (7, 8)])
def test_shards_tile_the_tensor_with_sizes_differing_by_at_most_one(numel: int, world_size: int) -> None:
    bounds = comm.shard_bounds(numel, world_size)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in pairwise(bounds))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [comm.shard_range(numel, world_size, r) for r in range(world_size)] == bounds


@pytest.mark.parametrize("n", range(1, 18))
def test_binomial_tree_is_a_spanning_tree_with_contiguous_subtrees(n: int) -> None:
    for v in range(1, n):
        assert v in binomial_children(binomial_parent(v), n)
    assert sorted(c for v in range(n) for c in binomial_children(v, n)) == list(range(1, n))
    for v in range(n):
        lo, hi = binomial_subtree(v, n)
        assert lo == v and sum(binomial_subtree(c, n)[1] - c for c in binomial_children(v, n)) == hi - lo - 1
    depth = max(bin(v).count("1") for v in range(n))
    assert depth == (math.ceil(math.log2(n)) if n > 1 else 0) or depth <= math.ceil(math.log2(n))


def test_node_groups_from_ranks_per_node_or_an_explicit_partition() -> None:
    assert node_groups(4, 2) == [(0, 1), (2, 3)]
    assert node_groups(3, [[2, 0], [1]]) == [(2, 0), (1,)]
    with pytest.raises(ValueError, match="does not divide world size 6"):
        node_groups(6, 4)
    with pytest.raises(ValueError, match="must partition ranks 0..2"):
        node_groups(3, [[0, 1], [1, 2]])


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer(n: int) -> None:
    S = 4 * 1024 * n  # divisible: no chunk rounding
    cost = collective_cost("all_reduce", "ring", S // 4, 4, n)
    assert cost.bytes_sent == (2 * (n - 1) * S // n,) * n
    assert cost.steps() == 2 * (n - 1)
    link = Link(alpha=1e-5, beta=1e9)
    assert cost.predict(link) == pytest.approx(2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * S / 1e9)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_tree_and_naive_all_reduce_match_their_closed_forms(n: int) -> None:
    S, link = 4000, Link(alpha=1e-5, beta=1e9)
    tree = collective_cost("all_reduce", "tree", S // 4, 4, n)
    rounds = math.ceil(math.log2(n))
    assert tree.steps() == 2 * rounds
    assert tree.predict(link) == pytest.approx(2 * rounds * (1e-5 + S / 1e9))
    assert tree.bytes_sent[0] == len(binomial_children(0, n)) * S  # the root: contention
    assert max(tree.bytes_sent[1:]) <= (1 + rounds) * S
    naive = collective_cost("all_reduce", "naive", S // 4, 4, n)
    assert naive.bytes_sent == ((n - 1) * S,) * n and naive.steps() == 1
    assert naive.predict(link) == pytest.approx(1e-5 + (n - 1) * S / 1e9)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_half_duplex_link_charges_sending_and_receiving_in_the_same_round_twice(n: int) -> None:
    """A ring round (send a chunk and receive one) moves 2S/n; a tree round moves S one way."""
    S = 4 * 1024 * n
    half, full = Link(alpha=1e-5, beta=1e9, duplex=False), Link(alpha=1e-5, beta=1e9)
    ring = collective_cost("all_reduce", "ring", S // 4, 4, n)
    assert ring.predict(half) == pytest.approx(2 * (n - 1) * 1e-5 + 2 * 2 * (n - 1) / n * S / 1e9)
    assert ring.load(duplex=False) == 2 * ring.load(duplex=True)
    tree = collective_cost("all_reduce", "tree", S // 4, 4, n)
    assert tree.predict(half) == pytest.approx(tree.predict(full))
    naive = collective_cost("all_reduce", "naive", S // 4, 4, n)
    assert naive.predict(half) == pytest.approx(1e-5 + 2 * (n - 1) * S / 1e9)
    bcast = collective_cost("broadcast", "ring", S // 4, 4, n)  # the chain: inner ranks forward and receive
    assert bcast.load(duplex=False) == (1 if n == 2 else 2) * bcast.load(duplex=True)


def test_tree_beats_ring_for_small_messages_and_loses_for_large_ones() -> None:
    link = Link(alpha=50e-6, beta=1e9)
    small = {a: collective_cost("all_reduce", a, 1024, 4, 8).predict(link) for a in ("ring", "tree")}
    large = {a: collective_cost("all_reduce", a, 16 << 20, 4, 8).predict(link) for a in ("ring", "tree")}
    assert small["tree"] < small["ring"] and large["ring"] < large["tree"]


def test_hierarchical_charges_each_tier_its_own_link() -> None:
    cost = collective_cost("all_reduce", "hierarchical", 1 << 20, 4, 8, nodes=4)
    assert cost.steps("node") == 2 * 2 and cost.steps("net") == 2 * (2 - 1)
    fast, slow = Link(1e-6, 100e9), Link(1e-4, 1e9)
    both = cost.predict({"node": fast, "net": slow})
    assert cost.predict({"node": fast, "net": fast}) < both < cost.predict({"node": slow, "net": slow})
    # Only the two leaders send across the network: a full ring all-reduce of S between them.
    flat = collective_cost("all_reduce", "ring", 1 << 20, 4, 8)
    assert cost.predict({"node": fast, "net": slow}) < flat.predict(slow)


def test_busbw_factors_follow_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("reduce_scatter", 4) == busbw_factor("all_gather", 4) == 0.75
    assert busbw_factor("all_reduce", 1) == 0.0


# --------------------------------------------------------------------- measured bytes


def _bytes_sent(rank: int, world_size: int, cases: list[tuple]) -> list[tuple[int, int]]:
    out = []
    for collective, algorithm, n, dtype, src in cases:
        traffic = comm.Traffic()
        x = torch.ones(n, dtype=dtype)
        nodes = 2 if world_size % 2 == 0 else [[world_size - 1], list(range(world_size - 1))]
        kw = dict(algorithm=algorithm, nodes=nodes, traffic=traffic)
        a, b = comm.shard_range(n, world_size, rank)
        if collective == "all_reduce":
            comm.all_reduce(x, **kw)
        elif collective == "reduce_scatter":
            comm.reduce_scatter(torch.empty(b - a, dtype=dtype), x, **kw)
        elif collective == "all_gather":
            comm.all_gather(x, x[a:b].clone(), **kw)
        else:
            comm.broadcast(x, src, **kw)
        modelled = comm.sent_bytes(collective, n, x.element_size(), algorithm=algorithm, nodes=nodes) \
            if collective != "broadcast" else traffic.bytes_sent
        out.append((traffic.bytes_sent, traffic.rounds, traffic.peak_moved, modelled))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_bytes_each_rank_sends_equal_the_cost_model_exactly(world_size: int) -> None:
    nodes = 2 if world_size % 2 == 0 else [[world_size - 1], list(range(world_size - 1))]
    cases = [(c, a, n, dtype, src) for c in COLLECTIVES for a in OURS
             for n, dtype in ((1, torch.float32), (world_size + 1, torch.float16), (61, torch.int64))
             for src in ((0, world_size - 1) if c == "broadcast" else (0,))]
    measured = run_on_ranks(_bytes_sent, world_size, cases, timeout=150)
    for i, (collective, algorithm, n, dtype, src) in enumerate(cases):
        cost = collective_cost(collective, algorithm, n, torch.empty(0, dtype=dtype).element_size(),
                               world_size, nodes=nodes, src=src)
        sent = tuple(measured[r][i][0] for r in range(world_size))
        assert sent == cost.bytes_sent, (collective, algorithm, n, dtype, src, sent, cost.bytes_sent)
        assert tuple(measured[r][i][3] for r in range(world_size)) == sent  # what the engines report per step
        peak = max(measured[r][i][2] for r in range(world_size))  # the half-duplex load of the busiest round
        assert peak == max((r.moved for r in cost.rounds), default=0), (collective, algorithm, n, dtype, src)
        if algorithm == "ring" and collective == "all_reduce" and n >= world_size:
            assert all(measured[r][i][1] == cost.steps() == 2 * (world_size - 1) for r in range(world_size))


def _native_sent(rank: int, world_size: int) -> dict:
    nbytes = lambda kind, numel, **kw: comm.sent_bytes(kind, numel, 4, **kw)  # noqa: E731
    return {"scatter": nbytes("reduce_scatter", 12), "scatter_consumed": nbytes("reduce_scatter", 12, consume_input=True),
            "scatter_uneven": nbytes("reduce_scatter", 13), "all_reduce": nbytes("all_reduce", 12),
            "all_reduce_13": nbytes("all_reduce", 13)}


def test_native_collectives_are_counted_as_the_collective_the_backend_runs() -> None:
    """gloo runs a consumed reduce-scatter, and any uneven one, as an all-reduce: it sends what that sends."""
    got = run_on_ranks(_native_sent, 3)
    for rank, sent in enumerate(got):
        assert sent["scatter"] == collective_cost("reduce_scatter", "ring", 12, 4, 3).bytes_sent[rank] == 2 * 4 * 4
        assert sent["scatter_consumed"] == sent["all_reduce"] == 2 * sent["scatter"]
        assert sent["scatter_uneven"] == sent["all_reduce_13"]


@pytest.mark.parametrize("duplex", [True, False])
def test_fitting_recovers_the_link_that_generated_the_times(duplex: bool) -> None:
    from dptrain.comm.fit import fit_link

    truth = Link(alpha=300e-6, beta=0.8e9, gamma=100e-12, duplex=duplex)
    costs = [collective_cost(c, a, n, 4, 4) for c in COLLECTIVES for a in ("ring", "tree", "naive")
             for n in (1024, 65536, 1 << 20, 1 << 22)]
    seconds = [c.predict(truth) for c in costs]
    fitted = fit_link([c.steps() for c in costs], [c.load(duplex) for c in costs], seconds,
                      [sum(r.reduced for r in c.rounds) for c in costs])
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-6)
    assert fitted.gamma == pytest.approx(truth.gamma, rel=1e-6)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_link([1, 1], [10, 10], [1.0, 1.0])
