"""Bad input to the collectives: a clear error on every rank, never a gloo abort or a hang."""

from __future__ import annotations

import pytest
import torch

from dptrain import comm
from dptrain.testing import run_on_ranks


def _error_of(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _mismatched_lengths(rank: int, world_size: int, algorithm: str) -> str:
    return _error_of(lambda: comm.all_reduce(torch.ones(10 + rank), algorithm=algorithm, nodes=1))


@pytest.mark.parametrize("algorithm", ["native", "ring", "tree"])
def test_mismatched_lengths_are_reported_with_every_rank_and_size(algorithm: str) -> None:
    for error in run_on_ranks(_mismatched_lengths, 3, algorithm, timeout=60):
        assert error.startswith("CollectiveMismatchError"), error
        assert "disagree on the length (rank 0: 10, rank 1: 11, rank 2: 12)" in error


def _mismatched_algorithms(rank: int, world_size: int) -> str:
    return _error_of(lambda: comm.all_reduce(torch.ones(4), algorithm="ring" if rank else "tree"))


def test_ranks_calling_different_algorithms_are_told_so() -> None:
    for error in run_on_ranks(_mismatched_algorithms, 2, timeout=60):
        assert "disagree on the algorithm (rank 0: tree, rank 1: ring)" in error


def _one_rank_bad(rank: int, world_size: int, case: str) -> str:
    if case == "unknown":
        return _error_of(lambda: comm.all_reduce(torch.ones(4), algorithm="rign"))
    if case == "output_size":
        out = torch.empty(3 if rank == 1 else 2)  # 8 elements over 4 ranks: shards of 2
        return _error_of(lambda: comm.reduce_scatter(out, torch.ones(8), algorithm="ring"))
    if case == "device":
        t = torch.ones(4, device="meta" if rank == 0 else "cpu")
        return _error_of(lambda: comm.all_reduce(t, algorithm="ring"))
    if case == "avg_int":
        return _error_of(lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32), op="avg", algorithm="tree"))
    if case == "hier_nodes":
        return _error_of(lambda: comm.all_reduce(torch.ones(4), algorithm="hierarchical"))
    if case == "src":
        return _error_of(lambda: comm.broadcast(torch.ones(4), src=7, algorithm="ring"))
    raise AssertionError(case)


def test_unknown_algorithm_suggests_the_right_one() -> None:
    for error in run_on_ranks(_one_rank_bad, 4, "unknown", timeout=60):
        assert "unknown algorithm 'rign' (did you mean 'ring'?); choose one of native, ring" in error


def test_a_wrong_output_size_on_one_rank_stops_every_rank() -> None:
    errors = run_on_ranks(_one_rank_bad, 4, "output_size", timeout=60)
    assert "output has 3 elements, but rank 1's shard of a 8-element tensor over 4 ranks has 2" in errors[1]
    for rank in (0, 2, 3):
        assert "CollectiveMismatchError" in errors[rank] and "rank(s) [1] passed invalid arguments" in errors[rank]


def test_a_tensor_on_the_wrong_device_is_refused_on_every_rank() -> None:
    errors = run_on_ranks(_one_rank_bad, 2, "device", timeout=60)
    assert "tensor is on meta, but the group's backend is gloo, which needs cpu tensors" in errors[0]
    assert "rank(s) [0] passed invalid arguments" in errors[1]


@pytest.mark.parametrize("case,message", [
    ("avg_int", "op='avg' of a torch.int32 tensor is not an integer"),
    ("hier_nodes", "algorithm='hierarchical' needs nodes=: the ranks per node"),
    ("src", "src=7 is not a rank of this group of 2"),
])
def test_invalid_arguments_name_the_fix(case: str, message: str) -> None:
    for error in run_on_ranks(_one_rank_bad, 2, case, timeout=60):
        assert message in error, error
