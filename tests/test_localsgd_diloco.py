"""Local SGD and DiLoCo, the algorithms: identities with DDP, the formulas against written-out references on 2 and 3
ranks, the fast outer step against its per-tensor oracle, the schedule, and an exact resume from each wrapper's
checkpoint state in the middle of a round. (dptrain run, Engine and prepare() on them: tests/test_strategies.py and
tests/test_strategy_resume.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptrain.ddp import DistributedDataParallel
from dptrain.diloco import DiLoCo, DiLoCoOptions, outer_step_naive
from dptrain.diloco.outer import OuterStep, outer_optimizer
from dptrain.localsgd import LocalSGD, LocalSGDOptions, average_parameters, average_parameters_naive
from dptrain.testing import run_on_ranks

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(wrapped: nn.Module, rank: int, steps: int, lr: float = 0.1, momentum: float = 0.0,
           start: int = 0) -> list[list[torch.Tensor]]:
    """``steps`` SGD steps through the wrapper protocol, as the user API takes them; the parameters after each."""
    opt = torch.optim.SGD(wrapped.module.parameters(), lr=lr, momentum=momentum)
    return _steps(wrapped, opt, rank, range(start, start + steps))


def _steps(wrapped, opt, rank, steps) -> list[list[torch.Tensor]]:
    after = []
    for step in steps:
        x, y = _batch(rank, step)
        nn.functional.mse_loss(wrapped(x), y).backward()
        wrapped.before_optimizer_step()
        opt.step()
        opt.zero_grad()
        getattr(wrapped, "after_optimizer_step", lambda: None)()
        after.append([p.detach().clone() for p in wrapped.module.parameters()])
    return after


# ----------------------------------------------------------------------------- identities with DDP


def _identity(rank: int, world_size: int, strategy: str) -> list[float]:
    ddp = _train(DistributedDataParallel(_model()), rank, 6)
    wrapper = (LocalSGD(_model(), period=1) if strategy == "localsgd" else
               DiLoCo(_model(), period=1, outer_lr=1.0, outer_momentum=0.0))
    mine = _train(wrapper, rank, 6)
    return [max((a - b).abs().max().item() for a, b in zip(x, y, strict=True)) for x, y in zip(ddp, mine, strict=True)]


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_period_1_takes_ddps_steps(strategy, world_size):
    """Local SGD with H = 1, and DiLoCo with H = 1, outer lr 1, no momentum: each step is DDP's (plain SGD), to the
    rounding of averaging weights instead of gradients."""
    for rank_diffs in run_on_ranks(_identity, world_size, strategy):
        assert max(rank_diffs) < 1e-6, rank_diffs


# ----------------------------------------------------------------------------- local SGD


def _local_sgd(rank: int, world_size: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[bool]]:
    wrapper = LocalSGD(_model(), LocalSGDOptions(period=3, warmup_steps=2))
    got = _train(wrapper, rank, 9, momentum=0.5)
    # the written-out reference: DDP's averaged gradient for steps 0-1, then own gradients, and the models averaged
    # after steps 2, 5 and 8 (torch's PeriodicModelAverager(period=3, warmup_steps=2))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    want, averaged = [], []
    for step in range(9):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        if step < 2:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        opt.step()
        opt.zero_grad()
        average = step >= 2 and (step - 2) % 3 == 0
        if average:
            average_parameters_naive(list(model.parameters()))
        averaged.append(average)
        want.append([p.detach().clone() for p in model.parameters()])
    return got, want, averaged


@pytest.mark.parametrize("world_size", [2, 3])
def test_local_sgd_steps_as_written_out_and_averages_on_torchs_schedule(world_size):
    results = run_on_ranks(_local_sgd, world_size)
    for got, want, _ in results:
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    averaged = results[0][2]
    assert averaged == [False, False, True, False, False, True, False, False, True]
    for step, is_average in enumerate(averaged):  # equal replicas exactly when just averaged (or in the warm-up)
        equal = all(torch.equal(results[0][0][step][i], r[0][step][i]) for r in results for i in range(4))
        assert equal == (is_average or step < 2), step


def _average_oracle(rank: int, world_size: int) -> bool:
    torch.manual_seed(rank)
    a = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    b = copy.deepcopy(a)
    average_parameters(a)
    average_parameters_naive(b)
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_flat_average_is_the_per_tensor_oracle_bit_for_bit():
    assert all(run_on_ranks(_average_oracle, 2))


# ----------------------------------------------------------------------------- DiLoCo


def _diloco_reference(rank: int, world_size: int, warmup: int) -> tuple[list, list]:
    """``warmup`` DDP steps, then inner AdamW for H = 3 steps and the outer step as Algorithm 1 writes it, with the
    ranks' weights gathered; the global weights start where the warm-up ends."""
    options = DiLoCoOptions(period=3, outer_lr=0.7, outer_momentum=0.9, warmup_steps=warmup)
    wrapper = DiLoCo(_model(), options)
    opt = torch.optim.AdamW(wrapper.module.parameters(), lr=1e-2)
    got = _steps(wrapper, opt, rank, range(warmup + 7))

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    global_ = [p.detach().clone() for p in model.parameters()]
    outer = outer_optimizer(global_, 0.7, 0.9, True)
    want = []
    for step in range(warmup + 7):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        if step < warmup:  # the DDP engine's step: the mean gradient
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        inner.step()
        inner.zero_grad()
        if step + 1 == warmup:
            with torch.no_grad():
                for g, x_i in zip(global_, model.parameters(), strict=True):
                    g.copy_(x_i)
        if step >= warmup and (step + 1 - warmup) % 3 == 0:
            for g, x_i in zip(global_, model.parameters(), strict=True):
                everyone = [torch.empty_like(x_i) for _ in range(world_size)]
                dist.all_gather(everyone, x_i.detach().contiguous())
                g.grad = sum(g - x_j for x_j in everyone) / world_size  # mean pseudo-gradient
            outer.step()
            with torch.no_grad():
                for g, x_i in zip(global_, model.parameters(), strict=True):
                    x_i.copy_(g)
        want.append([p.detach().clone() for p in model.parameters()])
    return got, want


@pytest.mark.parametrize("world_size,warmup", [(2, 0), (3, 0), (2, 2)])
def test_diloco_steps_as_written_out(world_size, warmup):
    for got, want in run_on_ranks(_diloco_reference, world_size, warmup):
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _outer_oracle(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(5)]
    local_fast = [t + 0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(rank + 7)) for t in start]
    local_naive = [t.clone() for t in local_fast]
    fast = OuterStep(start, lr=0.7, momentum=0.9, nesterov=True)
    global_ = [t.clone() for t in start]
    naive = outer_optimizer(global_, 0.7, 0.9, True)
    for _ in range(3):  # the momentum matters from the second step on
        fast(local_fast)
        outer_step_naive(global_, local_naive, naive)
        for t in (*local_fast, *local_naive):
            t.add_(0.05)
    return all(torch.equal(a, b) for a, b in zip(local_fast, local_naive, strict=True))


def test_the_flat_outer_step_is_the_per_tensor_oracle_bit_for_bit():
    assert all(run_on_ranks(_outer_oracle, 2))


def _compressed(rank: int, world_size: int, codec: str) -> tuple[float, int, int]:
    wrapper = DiLoCo(_model(), period=2, compression=codec)
    _train(wrapper, rank, 4)
    metrics = wrapper.step_metrics()
    params = torch.cat([p.detach().reshape(-1) for p in wrapper.module.parameters()])
    everyone = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(everyone, params)
    spread = max((e - params).abs().max().item() for e in everyone)
    return spread, metrics["comm_bytes_per_step"], metrics["comm_compressed_bytes_per_step"]


@pytest.mark.parametrize("codec, ratio", [("bf16", 2), ("int8", 3.5)])
def test_a_compressed_outer_step_keeps_the_replicas_equal_and_sends_fewer_bytes(codec, ratio):
    for spread, raw, payload in run_on_ranks(_compressed, 2, codec):
        assert spread == 0.0  # every rank decodes the same mean
        assert 0 < payload and raw / payload >= ratio


# ----------------------------------------------------------------------------- exact resume mid-round


def _resume(rank: int, world_size: int, strategy: str) -> bool:
    def build():
        return (LocalSGD(_model(), period=4, warmup_steps=1) if strategy == "localsgd" else
                DiLoCo(_model(), period=4, compression="int8"))

    straight = build()
    opt = torch.optim.AdamW(straight.module.parameters(), lr=1e-2)
    expected = _steps(straight, opt, rank, range(10))[-1]

    first = build()
    opt = torch.optim.AdamW(first.module.parameters(), lr=1e-2)
    _steps(first, opt, rank, range(6))  # stops in the middle of a round
    saved = copy.deepcopy(first.checkpoint_state(opt))
    model_state = copy.deepcopy(first.module.state_dict())

    second = build()
    second.module.load_state_dict(model_state)
    opt2 = torch.optim.AdamW(second.module.parameters(), lr=1e-2)
    assert second.load_checkpoint_state(saved, opt2) is None
    resumed = _steps(second, opt2, rank, range(6, 10))[-1]
    return all(torch.equal(a, b) for a, b in zip(expected, resumed, strict=True))


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_a_round_resumed_from_the_checkpoint_state_continues_bit_for_bit(strategy):
    assert all(run_on_ranks(_resume, 2, strategy))


def _engine_resume(rank: int, world_size: int, strategy: str) -> bool:
    """The same through ``Engine``: ``engine.state_dict()`` in the middle of a round carries the strategy's own state
    (its run-state part: DiLoCo's global weights, outer momentum and residual; local SGD's schedule)."""
    from dptrain import BatchPlan, Engine

    options = (LocalSGDOptions(period=4, warmup_steps=1) if strategy == "localsgd" else
               DiLoCoOptions(period=4, compression="int8"))

    def build():
        return Engine(_model(), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                      BatchPlan.resolve(world_size, micro_batch_size=8), strategy=strategy, options=options,
                      lr_at=lambda step: 1e-2)

    def steps(engine, which):
        for step in which:
            x, y = _batch(rank, step)
            for xb, yb in engine.micro_steps(iter([(x, y)])):
                engine.backward(nn.functional.mse_loss(engine.model(xb), yb))
            engine.step()
        return [p.detach().clone() for p in engine.model.module.parameters()]

    expected = steps(build(), range(10))
    first = build()
    steps(first, range(6))  # stops in the middle of a round
    saved = copy.deepcopy(first.state_dict())
    second = build()
    assert second.load_state_dict(saved) == [] and set(saved["parts"]) == {strategy}
    resumed = steps(second, range(6, 10))
    return all(torch.equal(a, b) for a, b in zip(expected, resumed, strict=True))


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_an_engine_state_dict_resumes_the_strategy_bit_for_bit(strategy):
    assert all(run_on_ranks(_engine_resume, 2, strategy))


# ----------------------------------------------------------------------------- evaluation of the global weights


def _evaluation(rank: int, world_size: int) -> tuple[bool, bool, bool, bool]:
    """Mid-round, ``evaluating()`` holds the global weights (``full_state_dict()``'s) and gives the replica back bit
    for bit, through the wrapper and through ``prepare()``'s model."""
    import dptrain as dp

    wrapper = DiLoCo(_model(), period=4)
    _train(wrapper, rank, 6, lr=0.05)  # 2 inner steps into the second round
    replica = [p.detach().clone() for p in wrapper.module.parameters()]
    full = wrapper.full_state_dict()
    with wrapper.evaluating() as module:
        held = all(torch.equal(module.state_dict()[k], v) for k, v in full.items())
        moved = not all(torch.equal(p, r) for p, r in zip(module.parameters(), replica, strict=True))
    back = all(torch.equal(p, r) for p, r in zip(wrapper.module.parameters(), replica, strict=True))

    bare = _model()
    model, opt = dp.prepare(bare, torch.optim.SGD(bare.parameters(), lr=0.05), strategy="diloco",
                            options=DiLoCoOptions(period=4))[:2]
    x, y = _batch(rank, 0)
    for _ in range(2):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = dp.get_state_dict(model)
    with torch.no_grad(), model.evaluating() as same:
        prepared = same is model and all(torch.equal(same.module.state_dict()[k], v) for k, v in expected.items())
    return held, moved, back, prepared


def test_an_evaluation_mid_round_runs_on_the_global_weights_and_gives_the_replica_back():
    for held, moved, back, prepared in run_on_ranks(_evaluation, 2):
        assert held and moved and back and prepared
