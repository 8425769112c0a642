"""Collective fingerprints and the roll call: ranks about to make different collective calls all raise an error
naming each rank's call (instead of gloo's SIGABRT), a rank that never arrives is named with its last call, and
after a failed collective the ranks that reported nothing are named."""

from __future__ import annotations

import re
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptrain.comm.fingerprint import CollectiveCheck, CollectiveMismatchError, CollectiveTimeoutError, fingerprint
from dptrain.compress.codecs import Half
from dptrain.compress.hook import CompressionHook
from dptrain.ddp import DistributedDataParallel
from dptrain.runner.roll_call import is_collective_failure, roll_call
from dptrain.testing import RankFailedError, run_on_ranks

pytestmark = pytest.mark.timeout(120)


def _on_threads(world_size: int, fn, store: dist.Store | None = None) -> dict:
    """Run ``fn(rank, store)`` on one thread per rank over a shared in-memory store; rank -> result or error."""
    store, results = store if store is not None else dist.HashStore(), {}

    def go(rank: int) -> None:
        try:
            results[rank] = fn(rank, store)
        except Exception as e:
            results[rank] = e
    threads = [threading.Thread(target=go, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_fingerprint_names_op_dtypes_shapes_and_call_site():
    got = fingerprint("all_reduce", [torch.zeros(3, 4), torch.zeros(2, dtype=torch.bfloat16)], "bucket 2")
    assert got == "all_reduce(float32[3, 4], bfloat16[2]) for bucket 2"


def test_equal_calls_pass_and_spent_keys_are_deleted():
    def fn(rank, store):
        check = CollectiveCheck(5.0, store=store, rank=rank, world_size=3)
        for i in range(20):
            check.verify("all_reduce", [torch.zeros(i + 1)], f"bucket {i}")
        return check.calls
    store = dist.HashStore()
    results = _on_threads(3, fn, store)
    assert results == {0: 20, 1: 20, 2: 20}
    assert store.num_keys() == 3  # each rank's key of call #19 (read, but not known to be read by all)


def test_different_calls_raise_on_every_rank_naming_each_call():
    def fn(rank, store):
        check = CollectiveCheck(5.0, store=store, rank=rank, world_size=3)
        check.verify("all_reduce", [torch.zeros(8)], "bucket 0")
        check.verify("all_reduce", [torch.zeros(8 if rank != 1 else 1)], "bucket 0" if rank != 1 else "a metric")
    results = _on_threads(3, fn)
    for rank in range(3):
        assert isinstance(results[rank], CollectiveMismatchError), results[rank]
        text = str(results[rank])
        assert "collective #1 differs across ranks" in text
        assert "rank(s) [0, 2]: all_reduce(float32[8]) for bucket 0" in text
        assert "rank(s) [1]: all_reduce(float32[1]) for a metric" in text


def test_a_rank_that_never_arrives_is_named_with_its_last_call():
    def fn(rank, store):
        check = CollectiveCheck(1.0, store=store, rank=rank, world_size=3)
        check.verify("broadcast", [torch.zeros(2, dtype=torch.int64)], "step 1")
        if rank == 2:
            return "stopped"  # hangs, as far as the others can tell
        check.verify("all_reduce", [torch.zeros(4)], "bucket 0")
    results = _on_threads(3, fn)
    assert results[2] == "stopped"
    for rank in (0, 1):
        text = str(results[rank])
        assert isinstance(results[rank], CollectiveTimeoutError)
        assert text.startswith("rank(s) [2] did not reach collective #1 within 1 s"), text
        assert "rank 2's last checked call was #0: broadcast(int64[2]) for step 1" in text


def test_roll_call_names_the_silent_ranks():
    def fn(rank, store):
        if rank == 1:
            return None  # hung: never reports
        return roll_call(7, wait_s=1.0, store=store, rank=rank, world_size=3)
    results = _on_threads(3, fn)
    for rank in (0, 2):
        assert results[rank].silent == [1]
        assert "rank(s) [1] reported nothing within 1 s" in results[rank].note, results[rank]
        assert "rank(s) [0, 2] reported failing" in results[rank].note
    every = _on_threads(2, lambda rank, store: roll_call(3, wait_s=5.0, store=store, rank=rank, world_size=2))
    assert all(every[r].silent == [] and "no rank is silent" in every[r].note for r in (0, 1)), every


def test_only_a_lost_peer_or_a_timeout_calls_the_roll():
    assert is_collective_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:36752"))
    assert is_collective_failure(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert not is_collective_failure(ValueError("fault injected by DPTRAIN_FAULT on rank 1 at step 3"))
    assert not is_collective_failure(TimeoutError("the data source timed out"))  # this rank's own problem


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _rank_dependent_hook(rank, world_size, check):
    """Rank 1 compresses its buckets to fp16 (a config read only on some hosts); the others do not."""
    model = DistributedDataParallel(_model(), check_collectives=check, check_timeout_s=20)
    hook = CompressionHook(Half(torch.float16))  # made on every rank: it makes a process group
    if rank == 1:
        model.register_comm_hook(None, hook)
    model(torch.randn(4, 8)).sum().backward()
    return "trained"


def test_a_comm_hook_on_one_rank_only_is_an_error_on_every_rank():
    with pytest.raises(RankFailedError) as caught:
        run_on_ranks(_rank_dependent_hook, 2, "first", timeout=60)
    text = str(caught.value)
    assert re.search(r"rank [01] also failed: dptrain.comm.fingerprint.CollectiveMismatchError", text), text
    assert "SIGABRT" not in text
    assert "rank(s) [0]: all_reduce(float32[" in text and "rank(s) [1]: comm hook CompressionHook(float32[" in text


def test_without_the_check_the_same_job_aborts():
    """The premise: gloo meets the two ranks' different sizes with SIGABRT, and no Python error at all."""
    with pytest.raises(RankFailedError, match="SIGABRT|signal 6"):
        run_on_ranks(_rank_dependent_hook, 2, "off", timeout=60)


def _two_models(rank, world_size):
    """Two DDP models in one job, trained in turn, each checking every call: their checks must not mix."""
    a = DistributedDataParallel(_model(), check_collectives="every", check_timeout_s=20)
    b = DistributedDataParallel(nn.Linear(8, 3), check_collectives="every", check_timeout_s=20)
    for _ in range(3):
        a(torch.randn(4, 8)).sum().backward()
        b(torch.randn(4, 8)).sum().backward()
    return a.reducer.check.calls, b.reducer.check.calls


def test_two_models_check_their_own_calls():
    assert run_on_ranks(_two_models, 2, timeout=60) == [(3, 3), (3, 3)]


def test_check_collectives_must_be_a_known_mode():
    with pytest.raises(RankFailedError, match="check_collectives='sometimes': expected one of off, first, every"):
        run_on_ranks(_rank_dependent_hook, 1, "sometimes", timeout=60)


def _zero_rank_stops_before_backward(rank, world_size):
    """ZeRO-3: rank 1 leaves after its forward (a rank-dependent early exit); rank 0 goes on into backward."""
    from dptrain.zero import ZeRO

    model = ZeRO(_model(), stage=3, check_collectives="first", check_timeout_s=3)
    loss = model(torch.randn(4, 8)).sum()
    if rank == 1:
        return "left"
    loss.backward()


def test_zero_names_a_rank_that_never_reaches_its_reduce_scatter():
    with pytest.raises(RankFailedError) as caught:
        run_on_ranks(_zero_rank_stops_before_backward, 2, timeout=60)
    text = str(caught.value)
    assert "CollectiveTimeoutError: rank(s) [1] did not reach collective #1 within 3 s" in text, text
    assert "rank 0 was about to call reduce_scatter into float32(float32[" in text
    assert "rank 1's last checked call was #0: all_gather(float32[" in text


def _zero_agrees(rank, world_size):
    from dptrain.zero import ZeRO

    model = ZeRO(_model(), stage=3, check_collectives="every", check_timeout_s=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model.units[0].check.calls, len(model.units)


def test_zero3_with_every_call_checked_trains():
    (calls, units), other = run_on_ranks(_zero_agrees, 2, timeout=60)
    assert other == (calls, units) and calls == 2 * 2 * units  # each step: a gather and a reduce-scatter per unit
