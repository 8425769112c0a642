"""Uneven inputs: ranks with fewer batches join early and shadow the others, no hang.

Rank r gets 2 + r batches. At step s the active ranks are those with a batch left; each
contributes its micro-batch gradient, joined ranks contribute zeros, and the sum is
divided by the initial world size (default) or by the number of active ranks. The
reference replays exactly that in one process.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.distributed.algorithms.join import Join

from _models import build, flat_state, global_batch, loss_fn, max_relative_diff
from dptrain import DistributedDataParallel
from dptrain.testing import run_on_ranks

MICRO = 4


def _batches(rank: int) -> int:
    return 2 + rank


def _train_uneven(rank: int, world_size: int, model_name: str, how: str, divide_by_initial: bool,
                  algorithm: str = "native") -> dict:
    torch.manual_seed(0)
    reference = build(model_name)
    torch.manual_seed(0 if rank == 0 else rank + 50)
    local = build(model_name)
    ddp = DistributedDataParallel(local, bucket_cap_mb=0.0004, algorithm=algorithm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if how == "torch_join":
        context = Join([ddp], divide_by_initial_world_size=divide_by_initial)
    else:
        context = ddp.join(divide_by_initial_world_size=divide_by_initial)
    with context:
        for step in range(_batches(rank)):
            x, y = global_batch(model_name, step, MICRO * world_size)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            opt.zero_grad()
            loss_fn(model_name, ddp(x[rows]), y[rows]).backward()
            opt.step()
    _replay(reference, model_name, world_size, divide_by_initial)
    return {"diff": max_relative_diff(local, reference), "state": flat_state(local)}


def _replay(reference, model_name: str, world_size: int, divide_by_initial: bool) -> None:
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(_batches(world_size - 1)):
        active = [r for r in range(world_size) if step < _batches(r)]
        divisor = world_size if divide_by_initial else len(active)
        x, y = global_batch(model_name, step, MICRO * world_size)
        opt.zero_grad()
        for r in active:
            rows = slice(r * MICRO, (r + 1) * MICRO)
            (loss_fn(model_name, reference(x[rows]), y[rows]) / divisor).backward()
        opt.step()


@pytest.mark.parametrize("how", ["torch_join", "ddp_join"])
@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_uneven_inputs_match_the_replayed_reference(how: str, divide_by_initial: bool) -> None:
    results = run_on_ranks(_train_uneven, 3, "mlp", how, divide_by_initial)
    for rank, result in enumerate(results):
        assert result["diff"] <= 1e-5, f"rank {rank} differs from the reference by {result['diff']}"
        assert torch.equal(result["state"], results[0]["state"]), f"rank {rank} left Join unsynchronised"


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_joined_ranks_shadow_reductions_with_dptrains_own_algorithms(algorithm: str) -> None:
    results = run_on_ranks(_train_uneven, 3, "mlp", "ddp_join", False, algorithm)
    for rank, result in enumerate(results):
        assert result["diff"] <= 1e-5, f"{algorithm}: rank {rank} differs from the reference by {result['diff']}"
        assert torch.equal(result["state"], results[0]["state"])


def _train_uneven_batchnorm(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(build("bn"), find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    params_after_sync = []  # only synced steps keep the replicas' parameters identical
    with ddp.join():
        for step in range(_batches(rank)):
            x, y = global_batch("bn", step, MICRO)
            opt.zero_grad()
            synced = step % 2 == 1
            with contextlib.nullcontext() if synced else ddp.no_sync():
                loss_fn("bn", ddp(x), y).backward()
            if synced:
                opt.step()
                params_after_sync.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
    return {"after_sync": params_after_sync, "final": flat_state(ddp.module)}


def test_uneven_inputs_with_buffers_no_sync_and_unused_map() -> None:
    # Ranks that still have data must agree after every synced step, including steps
    # where another rank has already joined and only shadows the collectives (a shadow
    # out of step would hang or leave them with different gradients). At exit, Join's
    # final broadcast makes all replicas equal whatever happened, so that alone proves little.
    results = run_on_ranks(_train_uneven_batchnorm, 3, timeout=60)
    for rank, result in enumerate(results):
        for step, params in enumerate(result["after_sync"]):
            assert torch.equal(params, results[-1]["after_sync"][step]), (
                f"after synced step {step}, rank {rank}'s parameters differ from rank {len(results) - 1}'s")
        assert torch.equal(result["final"], results[0]["final"])


def _early_termination(rank: int, world_size: int) -> str:
    ddp = DistributedDataParallel(build("mlp"))
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(_batches(rank)):
                x, y = global_batch("mlp", step, MICRO)
                loss_fn("mlp", ddp(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_throw_on_early_termination_stops_every_rank() -> None:
    errors = run_on_ranks(_early_termination, 3)
    assert "exhausted all inputs" in errors[0]
    assert all("exhausted inputs" in e for e in errors[1:]), errors


def _uneven_with_changing_graph(rank: int, world_size: int) -> float:
    # Rank r has 2 + r batches; the shared checkpointed weight's gradient arrives in a
    # number of pieces that changes by step and rank, so active ranks re-reduce late
    # buckets while a joined rank shadows them with zeros.
    torch.manual_seed(0)
    reference = build("ckpt_reentrant")
    ddp = DistributedDataParallel(copy.deepcopy(reference), bucket_cap_mb=0.0004, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    segments = lambda step, r: 3 if (step + r) % 3 else 2  # noqa: E731
    with ddp.join():
        for step in range(_batches(rank)):
            x, y = global_batch("mlp", step, MICRO * world_size)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            opt.zero_grad()
            loss_fn("mlp", ddp(x[rows], segments=segments(step, rank)), y[rows]).backward()
            opt.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(_batches(world_size - 1)):
        x, y = global_batch("mlp", step, MICRO * world_size)
        ref_opt.zero_grad()
        for r in (r for r in range(world_size) if step < _batches(r)):
            rows = slice(r * MICRO, (r + 1) * MICRO)
            (loss_fn("mlp", reference(x[rows], segments=segments(step, r)), y[rows]) / world_size).backward()
        ref_opt.step()
    return max_relative_diff(ddp.module, reference)


def test_joined_ranks_shadow_late_re_reductions_too() -> None:
    for rank, diff in enumerate(run_on_ranks(_uneven_with_changing_graph, 3, timeout=60)):
        assert diff <= 1e-5, f"rank {rank}: {diff}"
