"""A run moves between ddp and ZeRO when it resumes, and continues exactly.

Both strategies write the same names (``dptrain.checkpoint.state``): ddp's
``model.pt`` / ``optimizer.pt`` and ZeRO's DCP ``sharded/``. Each test trains 3 AdamW
steps (two param groups: weight decay on matrices only) with one strategy, saves as
``dptrain run`` does, loads into a fresh model of the other strategy (other initial
weights, sometimes another world size) and trains 3 more steps on the same global
batches. The losses must equal an uninterrupted run's: the global batch, so the mean
loss, is the same; only the order of the gradient sums differs. The model is the tiny
GPT, whose output projection is tied to the embedding (one tensor, two names).

``dptrain run`` itself is driven from ddp to zero2 in :func:`test_dptrain_run_resumes_a_ddp_run_as_zero2`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _cli import dptrain
from _models import build, global_batch, loss_fn
from dptrain.api.engine import Engine
from dptrain.batching import BatchPlan
from dptrain.checkpoint.replicated import replicated_state
from dptrain.checkpoint.state import load_model_and_optimizer
from dptrain.models.gpt import Block
from dptrain.optim.build import build_optimizer, decays
from dptrain.testing import run_on_ranks
from dptrain.zero.checkpoint import save_sharded

GLOBAL, FIRST, TOTAL = 12, 3, 6
ZERO_KWARGS = {"zero1": {"bucket_cap_mb": 0.001}, "zero2": {"bucket_cap_mb": 0.001},
               "zero3": {"unit_classes": (Block,)}}


def _engine(strategy: str, world_size: int, seed: int) -> Engine:
    torch.manual_seed(seed)
    kwargs = dict(ZERO_KWARGS.get(strategy, {}), split_by=decays) if strategy != "ddp" else None
    return Engine(build("gpt"), lambda m: build_optimizer(m, "adamw", 0.01, 0.1, (0.9, 0.95), 0.0),
                  BatchPlan.resolve(world_size, GLOBAL, None, None), strategy=strategy, zero_kwargs=kwargs)


def _train(rank: int, world_size: int, strategy: str, steps: range, save: str | None, load: str | None,
           seed: int = 0) -> list[float]:
    """Train ``steps`` with ``strategy``; load the checkpoint directory ``load`` first, save into ``save`` after."""
    engine = _engine(strategy, world_size, seed)
    if load:
        load_model_and_optimizer(Path(load), engine, engine.device)
    micro = GLOBAL // world_size
    losses = []
    for step in steps:
        x, y = global_batch("gpt", step, GLOBAL)
        loss = loss_fn("gpt", engine.model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    if save:
        _save(engine, Path(save), rank)
    return losses


def _save(engine: Engine, path: Path, rank: int) -> None:
    """What dptrain run's checkpoint holds of the model and optimizer (runner/hooks/checkpoint.py, save_run_checkpoint)."""
    if engine.sharded:
        save_sharded(path / "sharded", engine.model, engine.optimizer)
    else:
        model_state, optim_state = replicated_state(engine.model.module, engine.optimizer)
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            torch.save(model_state, path / "model.pt")
            torch.save(optim_state, path / "optimizer.pt")
        dist.barrier()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved, resumed, world_size", [("zero2", "ddp", 2), ("zero3", "ddp", 1),
                                                       ("ddp", "zero3", 3), ("ddp", "zero1", 2)])
def test_a_checkpoint_of_one_strategy_continues_exactly_in_another(saved: str, resumed: str, world_size: int,
                                                                   tmp_path: Path) -> None:
    uninterrupted = run_on_ranks(_train, 2, "ddp", range(TOTAL), None, None, timeout=60)[0]
    path = str(tmp_path / "ckpt")
    first = run_on_ranks(_train, 2, saved, range(FIRST), path, None, timeout=60)[0]
    assert first == pytest.approx(uninterrupted[:FIRST], rel=1e-6)
    continued = run_on_ranks(_train, world_size, resumed, range(FIRST, TOTAL), None, path, 7, timeout=60)
    for rank_losses in continued:
        assert rank_losses == pytest.approx(uninterrupted[FIRST:], rel=1e-5), (saved, resumed, rank_losses)
    # without the optimizer state the continuation differs: the comparison would see a lost exp_avg
    fresh = run_on_ranks(_train, 1, resumed, range(FIRST, TOTAL), None, None, timeout=60)[0]
    assert not fresh == pytest.approx(uninterrupted[FIRST:], rel=1e-3)


def _train_records(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dptrain_run_resumes_a_ddp_run_as_zero2(tmp_path: Path) -> None:
    """6 steps of ddp straight (run a); 3 steps of ddp, then resumed to 6 with zero2 (run b), through the CLI."""
    common = ["--nproc", "2", "--set", "task.name=classifier", "--set", "checkpoint.every=3", "--set", "log.every=1",
              "--set", "log.progress=lines", "--set", "log.plots=false"]
    straight = dptrain("run", *common, "--set", "train.steps=6", "--run-dir", str(tmp_path / "a"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    first = dptrain("run", *common, "--set", "train.steps=3", "--run-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = dptrain("run", *common, "--set", "train.steps=6", "--set", "distributed.strategy=zero2",
                      "--run-dir", str(tmp_path / "b"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000003 at step 3" in resumed.stdout
    meta = json.loads((tmp_path / "b" / "checkpoints" / "step_00000006" / "meta.json").read_text())
    assert meta["format"] == "sharded" and meta["strategy"] == "zero2"
    a, b = _train_records(tmp_path / "a"), _train_records(tmp_path / "b")
    assert [r[0] for r in b] == list(range(1, 7))
    assert a[:3] == b[:3]  # the same ddp run up to the checkpoint
    for (step, loss_a, norm_a), (_, loss_b, norm_b) in zip(a[3:], b[3:], strict=True):
        assert loss_b == pytest.approx(loss_a, rel=1e-6) and norm_b == pytest.approx(norm_a, rel=1e-5), step


class _ScalarFirst(torch.nn.Module):
    """A unit whose first parameter is 0-dim: its optimizer state alone cannot tell per-element from scalar."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.scale * self.linear(x)


def _scalar_first_resume(rank: int, world_size: int) -> None:
    from dptrain.zero import ZeRO
    from dptrain.zero.checkpoint import load_full_state

    torch.manual_seed(0)
    x = torch.randn(8, 4)
    reference = _ScalarFirst()
    ddp_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    reference(x).square().mean().backward()
    ddp_optimizer.step()
    model_state, optim_state = replicated_state(reference, ddp_optimizer)

    torch.manual_seed(1)
    zero = ZeRO(_ScalarFirst(), stage=2)
    optimizer = torch.optim.AdamW(zero.parameters(), lr=0.1)
    load_full_state(zero, optimizer, model_state, optim_state, "test")
    for unit in zero.units:
        state = optimizer.state[unit.shard]
        assert state["exp_avg"].shape == unit.shard.shape and state["step"].dim() == 0

    for _ in range(2):  # both continue identically from the same state
        for model, opt in ((reference, ddp_optimizer), (zero, optimizer)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    zero_loss = float(zero(x).square().mean())
    assert abs(zero_loss - float(reference(x).square().mean())) < 1e-5


@pytest.mark.timeout(60)
def test_zero_resumes_ddp_state_of_a_unit_whose_first_parameter_is_a_scalar():
    run_on_ranks(_scalar_first_resume, 1)
