"""ZeRO with units some ranks skip: ``find_unused_parameters=True`` matches the DDP engine's.

A trunk, a branch and a head (``Branchy``), each its own unit; the branch runs on some
ranks and some steps only, by a schedule that includes steps where no rank runs it and,
with gradient accumulation, micro-steps where only the ``no_sync`` one does. After every
Adam step the gathered parameters equal DDP's (``find_unused_parameters=True``), and
before it each rank's gradient shard equals its slice of DDP's gradient, or is None
where DDP's is (a unit no rank used: the optimizer must skip it, momentum and all).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _models import build, global_batch, loss_fn
from dptrain import DistributedDataParallel
from dptrain.testing import RankFailedError, run_on_ranks
from dptrain.zero import ZeRO

STEPS, MICRO, TOLERANCE = 6, 3, 1e-5
# step -> micro-step -> ranks that run the branch
SCHEDULE = [[{0, 1, 2}], [{0}], [set()], [{1, 2}], [{2}], [{0, 1, 2}]]
SCHEDULE_ACCUM = [[{0}, {1}], [{0, 1, 2}, set()], [set(), set()], [set(), {0}], [{1}, {1, 2}], [{2}, set()]]


def _by_module(name: str, param: torch.Tensor) -> str:
    return name.split(".")[0]


def _zero_kwargs(stage: int) -> dict:
    if stage == 3:
        return {"unit_classes": (torch.nn.Linear,)}
    return {"bucket_cap_mb": 0.0004, "split_by": _by_module}  # trunk, branch and head never share a unit


def _skipping(rank: int, world_size: int, stage: int, accum: int, shard_size: int | None = None) -> float:
    schedule = SCHEDULE_ACCUM if accum > 1 else SCHEDULE
    torch.manual_seed(0)
    model = build("branchy")
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.0004, find_unused_parameters=True)
    zero = ZeRO(model, stage=stage, find_unused_parameters=True, shard_size=shard_size, **_zero_kwargs(stage))
    assert len(zero.units) == 3, [u.refs[0].name for u in zero.units]
    opts = [torch.optim.Adam(w.parameters(), lr=0.01) for w in (ddp, zero)]
    worst = 0.0
    for step in range(STEPS):
        x, y = global_batch("branchy", step, MICRO * world_size * accum)
        for wrapper, opt in zip((ddp, zero), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            for micro in range(accum):
                lo = (micro * world_size + rank) * MICRO
                sync = wrapper.no_sync() if micro < accum - 1 else torch.enable_grad()
                with sync:
                    out = wrapper(x[lo:lo + MICRO], use_branch=rank in schedule[step][micro])
                    (loss_fn("branchy", out, y[lo:lo + MICRO]) / accum).backward()
        worst = max(worst, _gradient_gap(ddp, zero))
        for opt in opts:
            opt.step()
        got = zero.gathered_state()
        for name, ref in ddp.module.named_parameters():
            worst = max(worst, ((got[name] - ref).abs().max() / ref.abs().max()).item())
    return worst


def _gradient_gap(ddp: DistributedDataParallel, zero: ZeRO) -> float:
    grads = {name: p.grad for name, p in ddp.module.named_parameters()}
    worst = 0.0
    for unit in zero.units:
        if grads[unit.refs[0].name] is None:  # no rank used it: DDP left .grad alone, so must ZeRO
            assert unit.shard.grad is None, f"unit {unit.index} ({unit.refs[0].name}) got a gradient"
            continue
        expected = torch.cat([grads[r.name].reshape(-1) for r in unit.refs])[unit.lo:unit.hi]
        if expected.numel():
            gap = (unit.shard.grad - expected).abs().max() / expected.abs().max().clamp_min(1e-6)
            worst = max(worst, gap.item())
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_units_some_ranks_skip_match_ddp_with_find_unused_parameters(stage: int, world_size: int) -> None:
    worst = run_on_ranks(_skipping, world_size, stage, 1, timeout=120)
    assert max(worst) <= TOLERANCE, worst


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_unit_used_only_in_a_no_sync_micro_step_is_reduced(stage: int) -> None:
    worst = run_on_ranks(_skipping, 3, stage, 2, timeout=120)
    assert max(worst) <= TOLERANCE, worst


def test_units_some_ranks_skip_under_hybrid_sharding() -> None:
    worst = run_on_ranks(_skipping, 4, 3, 1, 2, timeout=120)  # 2 shard groups of 2
    assert max(worst) <= TOLERANCE, worst


def _skip_without_the_flag(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    zero = ZeRO(build("branchy"), stage=1, **_zero_kwargs(1))
    x, y = global_batch("branchy", 0, MICRO * world_size)
    lo = rank * MICRO
    loss_fn("branchy", zero(x[lo:lo + MICRO], use_branch=rank == 0), y[lo:lo + MICRO]).backward()


def test_a_skipped_unit_without_the_flag_is_an_error_that_names_the_fix() -> None:
    with pytest.raises(RankFailedError, match="find_unused_parameters=True"):
        run_on_ranks(_skip_without_the_flag, 2, timeout=60)
