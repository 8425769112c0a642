"""The parameter server: sync equals the DDP engine, async with one worker equals one process, SSP's bound
holds for every applied gradient, backup rounds drop the late, a dead worker is survived (async) or named
(sync), a dead server ends every worker with an error, and bad layouts are refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptrain.ddp import DistributedDataParallel
from dptrain.optim.build import build_optimizer
from dptrain.ps import (
    Consistency,
    PSError,
    PSLayoutError,
    Roles,
    ShardServer,
    build_parameter_server,
    partition,
)
from dptrain.testing import RankFailedError, run_on_ranks

pytestmark = pytest.mark.timeout(120)

CLIP = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return build_optimizer(module, "adamw", 0.05, 0.1, (0.9, 0.99), 0.9)


def _batch(step: int, worker: int, workers: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * workers, 6, generator=g), torch.randint(0, 3, (4 * workers,), generator=g)
    return x[4 * worker:4 * worker + 4], y[4 * worker:4 * worker + 4]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _ps(rank, world_size, num_servers, consistency, steps, slow=None, leave_at=None, lookahead=False, pace=0.0):
    """A PS job: servers return (report, records); workers (parameters after every step, report).

    ``slow=(rank, seconds)`` makes one worker sleep that long per step; ``pace`` makes every other worker
    sleep that long, so the fast workers' rounds take a known least time."""
    model = _model()
    role = build_parameter_server(model, _optimizer, num_servers=num_servers, consistency=consistency,
                                  steps=steps, grad_clip=CLIP, lookahead=lookahead)
    if isinstance(role, ShardServer):
        report = role.serve()
        return report, [(r.worker, r.clock, r.staleness, r.delay) for r in role.records]
    workers, history, step = world_size - num_servers, [], 0
    while True:
        step += 1
        if leave_at == (rank, step):  # this worker's process group goes away: its links close, as in a crash
            dist.destroy_process_group()
            return "left"
        x, y = _batch(step, rank, workers)
        nn.functional.cross_entropy(model(x), y).backward()
        if slow and rank == slow[0]:
            time.sleep(slow[1])
        elif pace:
            time.sleep(pace)
        stop = role.step()
        history.append(_flat(model))
        if stop:
            return history, role.leave()


def _ddp(rank, world_size, steps):
    model = DistributedDataParallel(_model())
    opt, history = _optimizer(model), []
    for step in range(1, steps + 1):
        x, y = _batch(step, rank, world_size)
        nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        history.append(_flat(model.module))
    return history


@pytest.mark.parametrize("num_servers,workers", [(1, 2), (2, 3)])
def test_sync_equals_ddp_step_by_step(num_servers, workers):
    ps = run_on_ranks(_ps, workers + num_servers, num_servers, Consistency("sync"), 5)
    ddp = run_on_ranks(_ddp, workers, 5)
    for w in range(workers):
        assert len(ps[w][0]) == 5
        for step, (a, b) in enumerate(zip(ps[w][0], ddp[w], strict=True), 1):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, w=w, step=step: f"worker {w} step {step}: {m}")
    report = ps[0][1][f"server_rank{workers}"]
    assert report["updates"] == 5 and report["gradients"] == 5 * workers and report["staleness"] == {"0": 5 * workers}


def test_async_with_one_worker_equals_single_process():
    ps = run_on_ranks(_ps, 2, 1, Consistency("async"), 6)
    model, opt = _model(), None
    opt = _optimizer(model)
    for step, got in enumerate(ps[0][0], 1):
        x, y = _batch(step, 0, 1)
        nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(got, _flat(model), rtol=1e-5, atol=1e-6)
    assert len(ps[0][0]) == 6


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_never_applies_a_gradient_staler_than_its_bound(bound):
    """Worker 2 is slow; every recorded staleness stays within the bound, and the bound is reached."""
    results = run_on_ranks(_ps, 4, 1, Consistency("ssp", staleness=bound), 12, slow=(2, 0.03))
    report, records = results[3]
    assert len(records) == report["gradients"] == 36
    assert all(s <= bound for _, _, s, _ in records), records
    assert max(s for _, _, s, _ in records) == bound  # the fast workers do run ahead, up to the bound


def test_async_staleness_is_unbounded_with_a_straggler():
    """The oracle for the SSP test's premise: without a bound the fast workers run far ahead."""
    _, records = run_on_ranks(_ps, 4, 1, Consistency("async"), 12, slow=(2, 0.03))[3]
    assert max(s for _, _, s, _ in records) > 3
    assert sum(1 for w, *_ in records if w == 2) < 12  # the straggler pushed fewer of the 36 gradients


def test_backup_rounds_use_the_first_gradients_and_drop_the_late():
    """Worker 2 sleeps 10x longer than the paced fast workers, so rounds close without it while it computes
    and its gradients arrive late. (Unpaced, the fast workers once spent all 8 rounds before the straggler's
    first gradient came, and nothing was dropped.)"""
    rounds = 20
    results = run_on_ranks(_ps, 4, 1, Consistency("backup", backups=1), rounds, slow=(2, 0.05), pace=0.005)
    report, records = results[3]
    assert report["updates"] == rounds
    assert report["dropped"] >= 1  # the straggler's gradient, computed from an old version
    assert all(s == 0 and d == 0 for _, _, s, d in records)  # applied ones are always fresh
    assert {w for w, *_ in records} <= {0, 1, 2} and len(records) == 2 * rounds
    for history in (results[0][0], results[1][0]):
        assert torch.isfinite(history[-1]).all()


def test_a_dead_worker_does_not_stop_async():
    results = run_on_ranks(_ps, 4, 1, Consistency("async"), 15, leave_at=(2, 3))
    assert results[2] == "left"
    report, records = results[3]
    assert report["lost_workers"] == {"2": "its process died (connection closed)"}
    assert report["gradients"] == 45 and {w for w, *_ in records} == {0, 1, 2}
    assert report == results[0][1]["server_rank3"]  # rank 0 got the report


def test_a_dead_worker_ends_a_sync_run_with_its_name():
    with pytest.raises(RankFailedError, match="worker rank 2 is gone.*sync round needs every worker"):
        run_on_ranks(_ps, 4, 1, Consistency("sync"), 15, leave_at=(2, 3))


def _server_dies(rank, world_size):
    model = _model()
    role = build_parameter_server(model, _optimizer, num_servers=2, consistency=Consistency("async"), steps=50)
    if isinstance(role, ShardServer):
        if rank == 3:  # serves for a while, then its links close, as in a crash
            threading.Thread(target=role.serve, daemon=True).start()
            time.sleep(0.5)
            dist.destroy_process_group()
            return "gone"
        try:
            role.serve()
        except PSError as e:
            return str(e)
        return "served"
    try:
        while True:
            nn.functional.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
            time.sleep(0.01)
            role.step()
    except PSError as e:
        return str(e)


def test_a_dead_server_ends_every_worker_with_an_error():
    t0 = time.monotonic()
    results = run_on_ranks(_server_dies, 4, timeout=60)
    assert results[3] == "gone"
    for w in (0, 1):
        assert "parameter server rank 3 is gone" in results[w], results[w]
    assert "worker rank 0 is gone" in results[2]  # the other server: rank 0, the reporter, left with the error
    assert time.monotonic() - t0 < 30


def test_partition_balances_whole_tensors_in_order():
    assert partition([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert partition([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert partition([1, 1, 100], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    runs = partition([5, 7, 3, 9, 2, 8], 3)
    assert [i for r in runs for i in r] == list(range(6)) and all(len(r) for r in runs)


def test_bad_layouts_are_refused_with_the_values():
    with pytest.raises(PSLayoutError, match="3 servers for a model of 2 parameter tensors"):
        partition([4, 4], 3)
    with pytest.raises(PSLayoutError, match="world size 2 is too small for 2 server"):
        Roles(2, 2)
    with pytest.raises(PSLayoutError, match="at least 1 server"):
        Roles(3, 0)
    with pytest.raises(ValueError, match="staleness bound must be >= 0, got -1"):
        Consistency("ssp", staleness=-1)
    with pytest.raises(ValueError, match="backups=2 with 2 worker"):
        Consistency("backup", backups=2).check_workers(2)
    with pytest.raises(ValueError, match="unknown parameter-server mode 'hogwild'"):
        Consistency("hogwild")


def test_async_learning_rate_without_a_schedule_does_not_compound():
    """Each async update runs at the optimizer's own lr / workers, however many came before it."""
    model = _model()
    server = ShardServer(list(model.parameters()), _optimizer, {0: None, 1: None}, Consistency("async"), steps=10)
    for _ in range(3):
        server._apply(torch.ones_like(server.flat), 1.0 / server.num_workers)
        assert server.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 2)
