"""Gossip SGD: doubly stochastic mixing, the average preserved, consensus reached, one D-PSGD step by its
formula, identical data giving single-process training, and the CLI run with its consensus distance."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _cli import dptrain
from dptrain.api.engine import Engine
from dptrain.batching import BatchPlan
from dptrain.gossip.module import GossipDataParallel, mixing_peers
from dptrain.testing import run_on_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("topology", ["ring", "exponential"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_mixing_matrix_is_doubly_stochastic(topology, world_size):
    for step in range(4):
        w = torch.zeros(world_size, world_size, dtype=torch.float64)
        for r in range(world_size):
            send, recv, weight = mixing_peers(topology, r, world_size, step)
            w[r, r] += weight
            for j in recv:
                w[r, j] += weight
            for j in send:  # whoever r sends to receives from r
                assert r in mixing_peers(topology, j, world_size, step)[1]
        torch.testing.assert_close(w.sum(0), torch.ones(world_size, dtype=torch.float64))
        torch.testing.assert_close(w.sum(1), torch.ones(world_size, dtype=torch.float64))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _mixing(rank, world_size, topology):
    model = GossipDataParallel(_model(), topology)
    with torch.no_grad():
        model.flat.add_(torch.randn(model.flat.shape, generator=torch.Generator().manual_seed(rank)))
    mean = model.flat.clone()
    dist.all_reduce(mean)
    distances = [model.consensus_distance()]
    for _ in range(30):
        model.mix()
        distances.append(model.consensus_distance())
    now = model.flat.clone()
    dist.all_reduce(now)
    return mean, now, distances


@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_mixing_keeps_the_average_and_reaches_consensus(topology):
    results = run_on_ranks(_mixing, 4, topology)
    mean, now, distances = results[0]
    torch.testing.assert_close(now, mean, rtol=1e-5, atol=1e-5)
    assert distances[0] > 1.0 and distances[-1] < 1e-3 * distances[0]
    assert all(b <= a + 1e-9 for a, b in pairwise(distances))  # mixing never spreads the replicas


def _one_step(rank, world_size):
    """One D-PSGD step with SGD: x_i <- sum_j W_ij x_j - lr * g_i(x_i); returns what it needs to check it."""
    engine = Engine(_model(), lambda m: torch.optim.SGD(m.parameters(), lr=0.5), BatchPlan(world_size, 1, 1,
                                                                                           world_size),
                    strategy="gossip", gossip_kwargs={"topology": "ring"})
    model = engine.model
    with torch.no_grad():  # the replicas made different (the parameters are views of flat)
        model.flat.add_(0.1 * torch.randn(model.flat.shape, generator=torch.Generator().manual_seed(rank)))
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(100 + rank))
    before = model.flat.clone()
    engine.backward(model(x).square().sum())
    grad = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
    engine.step()
    return before, grad, model.flat.clone()


def test_one_step_follows_the_d_psgd_formula():
    results = run_on_ranks(_one_step, 3)
    for r in range(3):
        before_mix = sum(results[j][0] for j in range(3)) / 3  # ring of 3: every weight is 1/3
        torch.testing.assert_close(results[r][2], before_mix - 0.5 * results[r][1], rtol=1e-5, atol=1e-6)


def _same_data(rank, world_size, steps):
    engine = Engine(_model(), lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), BatchPlan(4, 4, 1, world_size),
                    strategy="gossip")
    for step in range(steps):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        engine.backward(engine.model(x).square().mean())
        engine.step()
    return engine.model.flat.clone()


def test_identical_data_on_every_rank_is_single_process_training():
    got = run_on_ranks(_same_data, 3, 5)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(5):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        opt.zero_grad()
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for flat in got:
        torch.testing.assert_close(flat, want, rtol=1e-5, atol=1e-6)


def _prepared_same_data(rank, world_size, steps):
    from dptrain import prepare

    model = _model()
    model, optimizer = prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01), strategy="gossip",
                               grad_accum_steps=2)
    for step in range(steps):
        for micro in range(2):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + micro))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.wrapper.flat.clone(), model.wrapper.steps


def test_prepare_with_gossip_mixes_once_per_window_and_trains_as_one_process():
    got = run_on_ranks(_prepared_same_data, 2, 3)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.cat([torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + m)) for m in range(2)])
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for flat, mixes in got:
        torch.testing.assert_close(flat, want, rtol=1e-5, atol=1e-6)
        assert mixes == 3


def test_gossip_run_reports_consensus_distance_and_bytes(tmp_path):
    run_dir = tmp_path / "run"
    done = dptrain("run", "--nproc", "3", "--run-dir", str(run_dir), "--set", "distributed.strategy=gossip",
                   "--set", "task.name=classifier", "--set", "train.steps=10", "--set", "train.global_batch_size=48",
                   "--set", "log.every=5", "--set", "log.progress=lines", "--set", "log.plots=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["consensus_distance"] > 0 for r in train)  # measured before the final averaging
    parameters = json.loads((run_dir / "summary.json").read_text())["parameters"]
    assert train[-1]["comm_bytes_per_step"] == 2 * 4 * parameters  # ring of 3: two neighbours, fp32
    assert (run_dir / "model.safetensors").exists()


def test_gossip_refuses_compression(tmp_path):
    done = dptrain("run", "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--set", "distributed.strategy=gossip",
                   "--set", "compression.method=int8", "--set", "task.name=classifier", cwd=tmp_path)
    assert done.returncode == 2 and "strategy gossip has none" in done.stderr


def test_a_resumed_gossip_run_continues_exactly(tmp_path):
    """Each rank's replica, optimizer state and mixing step are in the checkpoint (the replicas differ)."""
    from test_cli_run import _steps, _straight_and_resumed

    def saved_per_rank(run_dir):
        assert sorted(p.name for p in (run_dir / "checkpoints" / "step_00000003" / "gossip").iterdir()) \
            == ["rank0.pt", "rank1.pt"]

    a, b = _straight_and_resumed(tmp_path, ["--set", "distributed.strategy=gossip", "--set", "gossip.topology=exponential"],
                                 saved_per_rank)
    assert _steps(a) == _steps(b)
    assert [r["consensus_distance"] for r in a] == [r["consensus_distance"] for r in b]
