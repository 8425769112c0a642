"""Dynamic batching: shares follow speed, the samples of each step are those of the fixed split, and the
weighted gradient equals the global mean, so training is the same as with equal shares."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from _cli import dptrain
from dptrain.api.engine import Engine
from dptrain.batching import BatchPlan
from dptrain.data.balance import DynamicBatcher, DynamicLoader, split_shares
from dptrain.data.loader import ShardedLoader
from dptrain.testing import run_on_ranks

pytestmark = pytest.mark.timeout(180)


def test_split_shares_is_proportional_whole_and_at_least_the_minimum():
    assert split_shares(32, [1.0, 1.0]) == [16, 16]
    assert split_shares(30, [2.0, 1.0]) == [20, 10]
    assert split_shares(10, [1.0, 1.0, 1.0]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert split_shares(8, [100.0, 1.0], minimum=2) == [6, 2]
    assert sum(split_shares(97, [0.3, 1.7, 2.2, 0.9])) == 97
    with pytest.raises(ValueError, match="global batch of 3 cannot give 2 ranks at least 2"):
        split_shares(3, [1.0, 1.0], minimum=2)


def _dataset(n=96):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.arange(n), torch.randn(n, 5, generator=g))


@pytest.mark.parametrize("shares", [[8, 8], [11, 5], [1, 15]])
def test_a_step_takes_the_same_samples_as_the_fixed_split(shares):
    """Over both ranks, each step's samples are exactly those the fixed-split loader gives that step."""
    data, plan = _dataset(), BatchPlan(16, 8, 1, 2)
    fixed = [ShardedLoader(data, plan, r, seed=3).micro_batches() for r in range(2)]
    dynamic = []
    for r in range(2):
        batcher = DynamicBatcher(16, 2, r)
        batcher.shares = shares
        dynamic.append(DynamicLoader(data, batcher, steps_per_epoch=6, seed=3).steps())
    for _ in range(8):  # past an epoch boundary
        want = sorted(int(i) for r in range(2) for i in next(fixed[r])[0])
        got = [next(d) for d in dynamic]
        assert [len(m[0][0][0]) for m in got] == shares
        assert sorted(int(i) for m in got for i in m[0][0][0]) == want


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _train(rank, world_size, shares, accum):
    data = _dataset()
    plan = BatchPlan.resolve(world_size, 16, None, accum)
    engine = Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), plan)
    batcher = DynamicBatcher(16, world_size, rank, accum=accum)
    batcher.shares = shares
    steps = DynamicLoader(data, batcher, steps_per_epoch=6, seed=0).steps()
    for _ in range(4):
        for (idx, x), weight in next(steps):
            y = idx.float().unsqueeze(1) / 100
            engine.backward(nn.functional.mse_loss(engine.model(x), y), weight)
        engine.step()
    return [p.detach().clone() for p in engine.model.module.parameters()]


def _fixed(rank, world_size):
    data = _dataset()
    plan = BatchPlan.resolve(world_size, 16, None, 1)
    engine = Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), plan)
    batches = engine.loader(data, seed=0).micro_batches()
    for _ in range(4):
        for idx, x in engine.micro_steps(batches):
            engine.backward(nn.functional.mse_loss(engine.model(x), idx.float().unsqueeze(1) / 100))
        engine.step()
    return [p.detach().clone() for p in engine.model.module.parameters()]


def _reference(world_size):
    """The fixed split through the engine's usual path: what dynamic batching must reproduce."""
    return run_on_ranks(_fixed, world_size)[0]


@pytest.mark.parametrize("shares,accum", [([11, 5], 1), ([3, 13], 1), ([9, 7], 2)])
def test_unequal_shares_train_exactly_like_equal_ones(shares, accum):
    reference = _reference(2)
    results = run_on_ranks(_train, 2, shares, accum)
    for got in results:
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _rebalance(rank, world_size):
    batcher = DynamicBatcher(24, world_size, rank, every=2, smoothing=0.0)
    slow = 3.0 if rank == 1 else 1.0
    for step in (1, 2):
        batcher.observe(step, slow * 0.001 * batcher.shares[rank])
    return batcher.shares


def test_shares_move_from_a_slow_rank_to_the_fast_ones():
    shares = run_on_ranks(_rebalance, 3)
    assert shares[0] == shares[1] == shares[2]  # every rank computed the same shares
    assert shares[0] == [10, 4, 10]  # speeds 1 : 1/3 : 1


def test_dynamic_batching_run_matches_the_fixed_split_and_helps_the_straggler(tmp_path):
    common = ["--nproc", "2", "--set", "task.name=classifier", "--set", "train.steps=12", "--set", "log.every=2",
              "--set", "log.progress=lines", "--set", "log.plots=false", "--set", "checkpoint.every=0",
              "--set", "straggler.rank=1", "--set", "straggler.factor=3", "--set", "balance.every=2"]
    losses = {}
    for dynamic in ("false", "true"):
        run_dir = tmp_path / dynamic
        done = dptrain("run", "--run-dir", str(run_dir), *common, "--set", f"balance.dynamic_batching={dynamic}",
                       cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[dynamic] = [r["loss"] for r in records if r["kind"] == "train"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stragglers"]["slowest_rank"] == 1 or dynamic == "true"
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)
    shares = [r["batch_shares"] for r in records if r["kind"] == "train"]
    assert shares[-1][0] > shares[-1][1] and sum(shares[-1]) == 32
    assert "stragglers" in done.stdout


def test_a_straggler_sleeps_factor_minus_one_times_its_last_compute(monkeypatch):
    """The injected straggler's own rule, exactly (the end-to-end runs only see that it is slowest)."""
    from dptrain.runner import straggler

    slept = []
    monkeypatch.setattr(straggler.time, "sleep", slept.append)
    s = straggler.Straggler(3.0)
    s.delay()  # no compute measured yet: no sleep
    s.step_done(0.010)
    s.delay()  # 2 x the 10 ms computed
    s.step_done(0.010 + 0.020 + 0.005)  # this step: 10 ms of compute, its 20 ms sleep, 5 ms more compute
    s.delay()
    assert slept == [pytest.approx(0.020), pytest.approx(0.030)]
    with pytest.raises(ValueError, match="factor must be >= 1"):
        straggler.Straggler(0.5)
