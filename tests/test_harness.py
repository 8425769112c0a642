"""The harness itself: results come back, failures and hangs become errors with a cause."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from dptrain.testing import RankFailedError, RankTimeoutError, run_on_ranks


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    expected = sum(range(world_size)) * 2.0
    assert run_on_ranks(_sum_of_ranks, world_size, 2.0) == [expected] * world_size


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # would wait for rank 1 forever


def test_the_failing_ranks_traceback_is_shown_first():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(_rank_one_raises, 3, timeout=60)
    message = str(failure.value)
    assert message.startswith("rank 1 of 3 failed first") and "ValueError: rank one is broken" in message
    assert time.monotonic() - start < 30, "the other ranks should be torn down, not waited for"


def _rank_zero_aborts(rank, world_size):
    if rank == 0:
        os.abort()
    time.sleep(60)


def test_a_rank_killed_by_a_signal_is_reported():
    with pytest.raises(RankFailedError, match="rank 0 died without a Python exception: killed by signal SIGABRT"):
        run_on_ranks(_rank_zero_aborts, 2, timeout=60)


def _rank_zero_hangs(rank, world_size):
    if rank == 0:
        time.sleep(120)
    dist.barrier()


def test_a_hang_becomes_a_timeout_with_every_ranks_stack():
    with pytest.raises(RankTimeoutError) as failure:
        run_on_ranks(_rank_zero_hangs, 2, timeout=2, collective_timeout=60)
    message = str(failure.value)
    assert "ranks [0, 1] still running" in message
    assert "in _rank_zero_hangs" in message and "--- rank 1 stacks ---" in message
