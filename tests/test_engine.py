"""The Engine (the Python API for your own loop) against one process on the global batch."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from dptrain import BatchPlan, Engine, warmup_cosine
from dptrain.data.loader import ShardedLoader
from dptrain.testing import run_on_ranks

MICRO, ACCUM, STEPS = 3, 2, 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(world_size):
    g = torch.Generator().manual_seed(1)
    n = STEPS * MICRO * ACCUM * world_size
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _lr(step):
    return warmup_cosine(step, 0.05, 2, STEPS, 0.1)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.1)


def _engine_run(rank, world_size):
    x, y = _data(world_size)
    plan = BatchPlan.resolve(world_size, micro_batch_size=MICRO, grad_accum_steps=ACCUM)
    model = _model()
    engine = Engine(model, _optimizer(model), plan, grad_clip=0.5, lr_at=_lr)
    per_step = plan.global_batch_size
    infos = []
    for step in range(STEPS):
        # rank r, micro-step k: its own slice of the step's global batch
        micro = iter([(x[s:s + MICRO], y[s:s + MICRO]) for k in range(ACCUM)
                      for s in [step * per_step + (rank * ACCUM + k) * MICRO]])
        for xb, yb in engine.micro_steps(micro):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(xb), yb)
            engine.backward(loss)
        infos.append(engine.step())
    return [p.detach().clone() for p in model.parameters()], infos


def _reference(world_size):
    x, y = _data(world_size)
    model = _model()
    optimizer = _optimizer(model)
    per_step = MICRO * ACCUM * world_size
    norms = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step)
        loss = F.cross_entropy(model(x[step * per_step:(step + 1) * per_step]), y[step * per_step:(step + 1) * per_step])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    return list(model.parameters()), norms


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_engine_matches_one_process_on_the_global_batch(world_size):
    results = run_on_ranks(_engine_run, world_size)
    expected, norms = _reference(world_size)
    for params, infos in results:
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        assert [i.grad_norm for i in infos] == pytest.approx(norms, rel=1e-5)
        assert [i.lr for i in infos] == pytest.approx([_lr(s) for s in range(STEPS)])
        assert [i.step for i in infos] == list(range(1, STEPS + 1)) and not any(i.skipped for i in infos)


def _nonfinite_step(rank, world_size):
    plan = BatchPlan.resolve(world_size, micro_batch_size=2)
    model = _model()
    before = copy.deepcopy(model.state_dict())
    engine = Engine(model, _optimizer(model), plan, grad_clip=1.0, lr_at=lambda s: 0.1)
    x = torch.randn(2, 5)
    if rank == 1:
        x[0, 0] = float("inf")  # one rank's bad sample poisons the averaged gradient everywhere
    for xb in engine.micro_steps(iter([x])):
        engine.backward(engine.model(xb).sum())
    info = engine.step()
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return info.skipped, unchanged, engine.skipped_steps


def test_non_finite_gradients_skip_the_step_on_every_rank():
    assert run_on_ranks(_nonfinite_step, 2) == [(True, True, 1), (True, True, 1)]


def test_loader_resumes_at_any_step_and_covers_each_global_batch():
    dataset = TensorDataset(torch.arange(30))
    plan = BatchPlan.resolve(2, micro_batch_size=3, grad_accum_steps=2)  # global 12: 2 steps per epoch
    loaders = [ShardedLoader(dataset, plan, rank, seed=7) for rank in range(2)]
    assert loaders[0].steps_per_epoch == 2
    streams = [loader.micro_batches() for loader in loaders]
    steps = [[torch.cat([next(s)[0] for _ in range(2)]) for s in streams] for _ in range(5)]
    for step in steps:
        together = torch.cat(step)
        assert len(together) == 12 and len(together.unique()) == 12  # each step: 12 distinct samples
    assert not torch.equal(torch.cat(steps[0]).sort().values, torch.cat(steps[2]).sort().values)  # reshuffled
    for start in range(5):  # resuming at step `start` gives exactly what followed it
        for rank, loader in enumerate(loaders):
            resumed = loader.micro_batches(start)
            assert torch.equal(torch.cat([next(resumed)[0] for _ in range(2)]), steps[start][rank])


def test_the_step_core_averages_the_window_clips_and_skips_without_a_process_group():
    from dptrain.api.step import OptimizerStep

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    core = OptimizerStep(optimizer, grad_clip=1e9)
    x = torch.randn(6, 5)
    for half in (x[:3], x[3:]):  # two micro-steps of one window: gradients summed by backward
        F.mse_loss(model(half), torch.zeros(3, 3)).backward()
    reference = _model()
    for half in (x[:3], x[3:]):
        (F.mse_loss(reference(half), torch.zeros(3, 3)) / 2).backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
    want = [p.detach() - p.grad for p in reference.parameters()]
    outcome = core(2)
    assert outcome.grad_norm == pytest.approx(want_norm, rel=1e-6) and not outcome.skipped
    for got, expected in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(got.detach(), expected)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none) after the step
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.full((1, 5), float("nan"))).sum().backward()
    assert core(1).skipped and (core.steps, core.skipped_steps) == (2, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
