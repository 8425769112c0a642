"""The simulator's model of strategies that meet every few steps (dptrain.planner.periodic) against its closed form,
the bytes it charges against DiLoCo's own count, and dptrain tune's handling of them: predicted and measured apart,
never chosen (dptrain.tune)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dptrain.comm.cost import Link
from dptrain.config import load_config
from dptrain.planner.network import Network
from dptrain.planner.periodic import simulate_periodic
from dptrain.planner.simulate import ComputeProfile
from dptrain.strategies import get_strategy
from dptrain.strategies.options import SyncSchedule
from dptrain.testing import run_on_ranks
from dptrain.tune.search import Measured, Row, SearchResult
from dptrain.tune.space import Candidate, apart, candidates
from dptrain.tune.trials import read_steps
from dptrain.tune.tuner import TuneOptions, trial_steps

PROFILE = ComputeProfile(0.010, 0.020, 0.005, {}, "test")  # an inner step of 35 ms


def _network(beta: float) -> Network:
    link = Link(1e-3, beta)
    return Network("test", link, link, 1, "test")


@pytest.mark.parametrize("beta, overlap", [(1e6, 0), (1e6, 1), (1e4, 0), (1e4, 1)])
def test_the_step_is_compute_and_each_sync_points_wait_beyond_its_overlap_spread_over_its_steps(beta, overlap):
    """Two parts of 600 and 400 fp32 values, a sync point every 3 steps, 2 ranks: a ring all-reduce of B bytes is a
    reduce-scatter and an all-gather, each one round of alpha + (B / 2) / beta; the wait beyond tau inner steps is
    spread over the 3 steps."""
    schedule = SyncSchedule(3, (600, 400), overlap, lambda n: 4 * n, 0, "fragment outer step")
    model = nn.Linear(10, 100)
    got = simulate_periodic(model, "diloco", schedule, 2, PROFILE, _network(beta))
    inner = 0.035
    syncs = [2 * (1e-3 + 4 * n / 2 / beta) for n in (600, 400)]
    exposed = [max(0.0, t - overlap * inner) for t in syncs]
    assert got.step_s == pytest.approx(inner + sum(exposed) / 6, rel=1e-9)
    assert got.comm_s == pytest.approx(sum(syncs) / 6, rel=1e-9)
    assert [c.nbytes for c in got.collectives] == [2400, 1600]
    if beta == 1e6 and overlap:  # 4.4 ms and 3.6 ms of reduction hide behind a 35 ms step
        assert got.step_s == pytest.approx(inner)
    one = simulate_periodic(model, "diloco", schedule, 1, PROFILE, _network(beta))
    assert one.step_s == pytest.approx(inner)  # alone: nothing to reduce


def test_the_features_name_the_terms_a_periodic_step_exercises_and_leave_every_other_at_zero():
    from dptrain.planner.simulate import Overheads

    schedule = SyncSchedule(3, (600, 400), 1, lambda n: 4 * n, 0, "fragment outer step")
    got = dict(zip(Overheads.names(), simulate_periodic(nn.Linear(10, 100), "diloco", schedule, 2, PROFILE,
                                                        _network(1e4), accum=2).features, strict=True))
    assert got["per_step_s"] == 1.0 and got["per_micro_step_s"] == 1.0
    assert got["comm_s_per_byte"] == pytest.approx((2400 + 1600) / 6) and got["contention_s_per_byte"] > 0
    assert got["state_s_per_byte"] == 4 * 1100 and got["compute_slowdown"] == pytest.approx(2 * 0.03 + 0.005)
    assert {k for k, v in got.items() if v} == {"per_step_s", "per_micro_step_s", "comm_s_per_byte",
                                                "contention_s_per_byte", "state_s_per_byte", "compute_slowdown"}


def test_the_schedule_is_refused_where_the_overlap_reaches_the_next_sync_point():
    with pytest.raises(ValueError, match="below the steps between two sync points"):
        simulate_periodic(nn.Linear(2, 2), "diloco", SyncSchedule(2, (6,), 2, lambda n: 4 * n, 0, "x"), 2, PROFILE,
                          _network(1e6))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def _payloads(rank: int, world_size: int, compression: str) -> int:
    """What DiLoCo itself counts as the encoded bytes of one round of its 2 fragments' sync points."""
    from dptrain.diloco import DiLoCo

    wrapper = DiLoCo(_model(), period=4, fragments=2, compression=compression)
    opt = torch.optim.SGD(wrapper.module.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        wrapper(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        wrapper.after_optimizer_step()
    m = wrapper.step_metrics()
    return round(m["comm_compressed_bytes_per_step"] * 4) if compression != "none" else round(
        m["comm_bytes_per_step"] * 4)


@pytest.mark.parametrize("compression", ["none", "int8", "e3m0"])
def test_dilocos_schedule_charges_the_bytes_diloco_counts(compression):
    """The registry's schedule for a config (2 fragments, every H / P = 2 steps) holds the fragments DiLoCo splits
    the model into, and charges each sync point the payload DiLoCo's own reduction encodes."""
    cfg = load_config(None, ["diloco.period=4", "diloco.fragments=2", f'diloco.compression="{compression}"'])
    schedule = get_strategy("diloco").sync_schedule(cfg, _model())
    assert schedule.every == 2 and sum(schedule.parts) == sum(p.numel() for p in _model().parameters())
    assert len(schedule.parts) == 2 and schedule.name == "fragment outer step"
    counted = run_on_ranks(_payloads, 1, compression)[0]
    assert sum(schedule.wire_bytes(n) for n in schedule.parts) == counted
    local = get_strategy("localsgd").sync_schedule(load_config(None, ["localsgd.period=5"]), _model())
    assert (local.every, local.parts, local.wire_bytes(10)) == (5, (sum(schedule.parts),), 40)


def test_tune_takes_them_apart_with_whole_rounds_of_sync_points_and_their_mean(tmp_path):
    space = candidates(2, 8, ["ddp", "diloco"], buckets=[1.0, 25.0])
    dil = [c for c in space if c.strategy == "diloco"]
    assert [c.label for c in dil] == ["diloco 4x1", "diloco 2x2", "diloco 1x4"]  # no bucket or codec to vary
    assert all(apart(c) for c in dil) and not any(apart(c) for c in space if c.strategy == "ddp")
    options = TuneOptions(steps=12, warmup=4)
    overrides = ["diloco.period=6", "diloco.fragments=2", "diloco.warmup_steps=5", 'distributed.strategy="diloco"']
    assert trial_steps(None, overrides, dil[0], options) == (4 + 5 + 2 * 6, 9)  # 2 rounds of 6 after both warm-ups
    assert trial_steps(None, ["diloco.period=3"], dil[0], options) == (4 + 3 * 3, 4)  # 8 measured steps: 3 rounds
    assert trial_steps(None, [], space[0], options) == (12, 4)
    lines = [json.dumps({"kind": "train", "step": s, "step_ms": ms}) for s, ms in enumerate((9, 1, 1, 7), 1)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert read_steps(tmp_path, 1, mean=True).step_s == pytest.approx(0.003)  # a sync point's step counted in
    assert read_steps(tmp_path, 1).step_s == pytest.approx(0.001)


def test_the_table_puts_them_below_never_chosen():
    from dptrain.tune.report import tables

    ddp, dil = Row(Candidate("ddp", 4, 1), predicted_s=0.2), Row(Candidate("diloco", 4, 1), predicted_s=0.05)
    ddp.measured, dil.measured, ddp.status, dil.status = [Measured(0.21)], [Measured(0.06)], "measured", "measured"
    text = tables(SearchResult([ddp], ddp, 2, apart=[dil]))
    ranked, below = text.split("Measured apart")
    assert "ddp 4x1 **best**" in ranked and "diloco" not in ranked
    assert "| diloco 4x1 | - | 50.0 | 60.0 | 1 | - | 0.83 |" in below and "best" not in below
