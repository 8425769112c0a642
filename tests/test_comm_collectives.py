"""dptrain's collectives against torch.distributed's own results, for every algorithm.

World sizes 1-5 (oversubscribed on small machines: fine for correctness), lengths that
do not divide evenly (0, 1, n-1, n+1, a prime, longer than n), fp32/fp16/bf16/int64.
Each world size runs all combinations in one launch of the ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.testing import run_on_ranks

ALGORITHMS = comm.ALGORITHMS
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)


def nodes_for(world_size: int):
    """Two even nodes when possible, else an uneven explicit grouping (leader first)."""
    if world_size % 2 == 0:
        return world_size // 2
    return [[0], list(range(1, world_size))] if world_size > 1 else 1


def lengths(world_size: int) -> list[int]:
    return sorted({0, 1, max(world_size - 1, 0), world_size + 1, 13, 4 * world_size + 3})


def sample(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 7 * n + salt)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype in (torch.float16, torch.bfloat16):
        # Per-hop rounding differs between algorithms; one ulp-ish of the magnitude.
        tol = 0.02 if got.dtype == torch.float16 else 0.15
        assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), what
    elif got.dtype.is_floating_point:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), what
    else:
        assert torch.equal(got, want), what  # integer sums are exact


def _all_reduce_matches_torch(rank: int, world_size: int) -> int:
    checked = 0
    for n in lengths(world_size):
        for dtype in DTYPES:
            x = sample(rank, n, dtype)
            want = x.clone()
            dist.all_reduce(want)
            for algorithm in ALGORITHMS:
                got = x.clone()
                comm.all_reduce(got, algorithm=algorithm, nodes=nodes_for(world_size))
                assert_close(got, want, f"all_reduce {algorithm} n={n} {dtype}")
                if dtype.is_floating_point:
                    avg = x.clone()
                    comm.all_reduce(avg, op="avg", algorithm=algorithm, nodes=nodes_for(world_size))
                    assert_close(avg, (want.double() / world_size).to(dtype), f"avg {algorithm} n={n}")
                checked += 1
    return checked


def _shards_match_torch(rank: int, world_size: int) -> int:
    checked = 0
    for n in lengths(world_size):
        for dtype in DTYPES:
            x = sample(rank, n, dtype)
            summed = x.clone()
            dist.all_reduce(summed)
            a, b = comm.shard_range(n, world_size, rank)
            # torch's all_gather over every rank's shard, padded to equal size.
            width = max(bb - aa for aa, bb in comm.shard_bounds(n, world_size)) if n else 0
            pieces = [torch.zeros(width, dtype=dtype) for _ in range(world_size)]
            mine = torch.zeros(width, dtype=dtype)
            mine[:b - a] = x[a:b]
            dist.all_gather(pieces, mine)
            gathered = torch.cat([p[:bb - aa] for p, (aa, bb) in zip(pieces, comm.shard_bounds(n, world_size), strict=True)])
            for src in {0, world_size - 1}:
                want_b = x.clone()
                dist.broadcast(want_b, src)
                for algorithm in ALGORITHMS:
                    got_b = x.clone()
                    comm.broadcast(got_b, src, algorithm=algorithm, nodes=nodes_for(world_size))
                    assert torch.equal(got_b, want_b), f"broadcast {algorithm} n={n} src={src} {dtype}"
            for algorithm in ALGORITHMS:
                out = torch.full((b - a,), 99, dtype=dtype)
                input_before = x.clone()
                comm.reduce_scatter(out, x, algorithm=algorithm, nodes=nodes_for(world_size))
                assert_close(out, summed[a:b], f"reduce_scatter {algorithm} n={n} {dtype}")
                assert torch.equal(x, input_before), "reduce_scatter wrote into its input"
                for own_shard in (False, True):  # a consumed input; the output its own shard or apart
                    given = x.clone()
                    out = given[a:b] if own_shard else torch.full((b - a,), 99, dtype=dtype)
                    comm.reduce_scatter(out, given, algorithm=algorithm, nodes=nodes_for(world_size),
                                        consume_input=True)
                    assert_close(out, summed[a:b], f"reduce_scatter consume_input {algorithm} n={n} {dtype}")
                full = torch.full((n,), 99, dtype=dtype)
                comm.all_gather(full, x[a:b], algorithm=algorithm, nodes=nodes_for(world_size))
                assert torch.equal(full, gathered), f"all_gather {algorithm} n={n} {dtype}"
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_all_reduce_matches_torch_for_every_algorithm_length_and_dtype(world_size: int) -> None:
    counts = run_on_ranks(_all_reduce_matches_torch, world_size, timeout=150)
    assert counts[0] == len(lengths(world_size)) * len(DTYPES) * len(ALGORITHMS)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_reduce_scatter_all_gather_broadcast_match_torch(world_size: int) -> None:
    counts = run_on_ranks(_shards_match_torch, world_size, timeout=150)
    assert counts[0] == len(lengths(world_size)) * len(DTYPES) * len(ALGORITHMS)


def _fp16_sums_in_fp32(rank: int, world_size: int) -> list[float]:
    # 2048 + 1 + 1 + 1 in fp16: adding 1s one at a time rounds each away (spacing is 2
    # at 2048); summed in fp32 and rounded once, the three 1s make 2051 -> 2052.
    x = torch.tensor([2048.0 if rank == 0 else 1.0], dtype=torch.float16)
    out = []
    for algorithm in ("naive", "tree"):
        y = x.clone()
        comm.all_reduce(y, algorithm=algorithm)
        out.append(y.item())
    return out


def test_half_precision_is_summed_in_fp32_where_an_algorithm_adds_locally() -> None:
    # Rank 0 is the tree's root with children 1, 2 (and 3 below 2): rank 0 adds two
    # incoming buffers; naive adds all four in one fp32 sum.
    naive, tree = run_on_ranks(_fp16_sums_in_fp32, 4)[0]
    assert naive == 2052.0
    assert tree == 2052.0


def _async_and_non_contiguous(rank: int, world_size: int) -> list[bool]:
    ok = []
    for algorithm in ALGORITHMS:
        tensors = [torch.full((5, 3), float(rank + i)) for i in range(4)]
        works = [comm.all_reduce(t, algorithm=algorithm, async_op=True, nodes=1) for t in tensors]
        results = [w.wait() for w in works]
        expected = [sum(r + i for r in range(world_size)) for i in range(4)]
        ok.append(all(torch.equal(r, torch.full((5, 3), float(e))) for r, e in zip(results, expected, strict=True)))
        ok.append(all(w.is_completed() and w.completed_at is not None for w in works))
        ok.append(all(r is t for r, t in zip(results, tensors, strict=True)))
        base = torch.arange(12.0).view(3, 4) + rank
        view = base.t()  # non-contiguous: communicated via a copy and written back
        assert not view.is_contiguous()
        comm.all_reduce(view, algorithm=algorithm, nodes=1)
        want = sum(torch.arange(12.0).view(3, 4) + r for r in range(world_size))
        ok.append(torch.equal(base, want))
    return ok


def test_async_handles_keep_call_order_and_non_contiguous_tensors_are_written_back() -> None:
    for rank, ok in enumerate(run_on_ranks(_async_and_non_contiguous, 3)):
        assert all(ok), (rank, ok)
