"""The step-time simulator: timelines on hand-made profiles, checked against the cost model. No process group."""

from __future__ import annotations

import dataclasses
import json
from itertools import pairwise

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dptrain.cli import main
from dptrain.comm.cost import Link, collective_cost
from dptrain.planner import Setup, units
from dptrain.planner.network import Network, custom_link, network
from dptrain.planner.simulate import ComputeProfile, flops_profile, simulate_step

LINK = Link(alpha=1e-4, beta=1e9)  # 100 us, 1 GB/s
NET = Network("test", LINK, LINK, 1, "hand-made")


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).to("meta")  # 8 x 65,792 parameters


def _profile(model: nn.Module, forward=0.1, backward=0.2, optimizer=0.01) -> ComputeProfile:
    # Gradients ready in reverse order, evenly through backward (the last layer's first).
    names = [n for n, _ in model.named_parameters()]
    ready = {n: (len(names) - i) / len(names) for i, n in enumerate(names)}
    return ComputeProfile(forward, backward, optimizer, ready, "hand-made")


def _all_reduce(numel: int, n: int, link: Link = LINK) -> float:
    return collective_cost("all_reduce", "ring", numel, 4, n).predict(link)


def test_one_rank_is_compute_alone() -> None:
    model = _model()
    p = simulate_step(model, Setup("ddp", 1), _profile(model), NET)
    assert p.step_s == pytest.approx(0.31) and p.exposed_s == 0 and p.comm_s == 0


def test_a_bucket_larger_than_the_model_defeats_overlap() -> None:
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    one = simulate_step(model, Setup("ddp", 4, bucket_cap_mb=100), _profile(model), NET)
    assert len(one.collectives) == 1
    assert one.collectives[0].launched_s == pytest.approx(0.3)  # at the end of backward
    assert one.exposed_s == pytest.approx(_all_reduce(numel, 4))  # all of it exposed
    many = simulate_step(model, Setup("ddp", 4, bucket_cap_mb=0.2), _profile(model), NET)  # a layer each
    assert len(many.collectives) == 8
    assert many.comm_s > one.comm_s  # more messages, more latency on the link...
    assert many.exposed_s == pytest.approx(_all_reduce(256 * 256 + 256, 4))  # ...all but the last layer hidden


def test_without_overlap_every_bucket_waits_for_the_end_of_backward() -> None:
    model = _model()
    p = simulate_step(model, Setup("ddp", 4, bucket_cap_mb=0.2), _profile(model), NET, overlap=False)
    assert len(p.collectives) == 8
    assert all(c.launched_s == pytest.approx(0.3) for c in p.collectives)
    assert p.exposed_s == pytest.approx(p.comm_s) == pytest.approx(8 * _all_reduce(256 * 256 + 256, 4))


def test_compression_sends_the_bucket_that_many_times_smaller() -> None:
    model = _model()
    numel = 256 * 256 + 256
    for ratio in (1, 3, 64):
        p = simulate_step(model, Setup("ddp", 4, bucket_cap_mb=0.2), _profile(model), NET, compression=ratio)
        assert p.comm_s == pytest.approx(8 * _all_reduce(-(-numel // ratio), 4))
    with pytest.raises(ValueError, match="positive integer"):
        simulate_step(model, Setup("ddp", 4), _profile(model), NET, compression=0)
    with pytest.raises(ValueError, match="apply to DDP"):
        simulate_step(model, Setup("zero2", 4), _profile(model), NET, compression=4)


def test_link_runs_one_collective_at_a_time_in_launch_order() -> None:
    model = _model()
    slow = Network("slow", Link(1e-4, 1e7), Link(1e-4, 1e7), 1, "hand-made")  # comm outlasts compute
    p = simulate_step(model, Setup("ddp", 2, bucket_cap_mb=0.3), _profile(model), slow)
    for a, b in pairwise(p.collectives):
        assert b.start_s == pytest.approx(max(b.launched_s, a.end_s))
    assert p.step_s == pytest.approx(p.collectives[-1].end_s + 0.01)
    buckets = units(model, Setup("ddp", 2, bucket_cap_mb=0.3))
    assert p.comm_s == pytest.approx(sum(_all_reduce(u.numel, 2, slow.net) for u in buckets))


def test_zero12_gather_before_forward_and_zero3_gathers_more() -> None:
    model = _model()
    prof = _profile(model)
    ddp = simulate_step(model, Setup("ddp", 4), prof, NET)
    z1 = simulate_step(model, Setup("zero1", 4), prof, NET)
    gathers = [c for c in z1.collectives if c.name.startswith("all_gather")]
    assert gathers and all(c.launched_s == 0 for c in gathers)
    assert z1.optimizer_s == pytest.approx(0.01 / 4)  # each rank steps its shard
    assert z1.step_s >= 0.3 + z1.optimizer_s + sum(c.end_s - c.start_s for c in gathers) - 1e-12
    z3 = simulate_step(model, Setup("zero3", 4, unit_classes=(nn.Linear,)), prof, NET)
    assert sum(c.name.startswith("all_gather") for c in z3.collectives) == 16  # forward and backward
    assert sum(c.name.startswith("reduce_scatter") for c in z3.collectives) == 8
    assert z3.comm_s > ddp.comm_s


def test_hierarchical_uses_both_tiers() -> None:
    model = _model()
    fast, slow = Link(1e-6, 1e11), Link(1e-4, 1e8)
    net = Network("two-tier", fast, slow, 4, "hand-made")
    flat = simulate_step(model, Setup("ddp", 8), _profile(model), net, "ring")
    tiers = simulate_step(model, Setup("ddp", 8), _profile(model), net, "hierarchical")
    assert tiers.comm_s < flat.comm_s  # the slow link carries only the leaders' ring


def test_zero_waits_for_the_previous_reduction_before_launching_the_next() -> None:
    # ReductionQueue(1): on a link slower than backward, each reduce-scatter is launched only
    # once the one before it is done, and compute is held back until then.
    model = _model()
    slow = Network("slow", Link(1e-4, 1e7), Link(1e-4, 1e7), 1, "hand-made")
    p = simulate_step(model, Setup("zero3", 2, unit_classes=(nn.Linear,)), _profile(model), slow)
    scatters = [c for c in p.collectives if c.name.startswith("reduce_scatter")]
    assert len(scatters) == 8
    for a, b in pairwise(scatters):
        assert b.launched_s >= a.end_s - 1e-12
    assert p.step_s == pytest.approx(scatters[-1].end_s + 0.01 / 2)


def test_zero1_in_place_launches_each_reduction_when_ready_the_others_wait() -> None:
    # ZeRO-1 accumulating in its own buffer holds no temporary gradient: its reduce-scatters queue on the link as
    # their units are ready and backward runs on; ZeRO-2 and a bf16 ZeRO-1 (its gradients cast: temporaries) wait.
    model = _model()
    slow = Network("slow", Link(1e-4, 1e6), Link(1e-4, 1e6), 1, "hand-made")  # each reduction outlasts backward

    def scatters(setup: Setup) -> tuple[list, float]:
        p = simulate_step(model, setup, _profile(model), slow)
        return [c for c in p.collectives if c.name.startswith("reduce_scatter")], p.step_s

    free, step = scatters(Setup("zero1", 2, bucket_cap_mb=0.3))
    assert Setup("zero1", 2).accumulates_in_place and len(free) > 2
    assert any(b.launched_s < a.end_s - 1e-9 for a, b in pairwise(free))  # launched while the one before runs
    for a, b in pairwise(free):
        assert b.start_s == pytest.approx(max(b.launched_s, a.end_s))
    assert step == pytest.approx(free[-1].end_s + 0.01 / 2)
    for held in (Setup("zero2", 2, bucket_cap_mb=0.3), Setup("zero1", 2, "bf16", bucket_cap_mb=0.3)):
        assert not held.accumulates_in_place
        bounded, _ = scatters(held)
        for a, b in pairwise(bounded):
            assert b.launched_s >= a.end_s - 1e-12
    hybrid, _ = scatters(Setup("zero1", 4, bucket_cap_mb=0.3, shard_size=2))
    for a, b in pairwise(hybrid):
        assert b.launched_s >= a.end_s - 1e-12


def test_gloos_native_reduce_scatter_costs_an_all_reduce() -> None:
    model = _model()
    setup = Setup("zero2", 4, bucket_cap_mb=100)
    nccl = simulate_step(model, setup, _profile(model), NET, "native")
    gloo = simulate_step(model, setup, _profile(model), dataclasses.replace(NET, backend="gloo"), "native")
    scatter = [c for c in gloo.collectives if c.name.startswith("reduce_scatter")][0]
    assert scatter.end_s - scatter.start_s == pytest.approx(_all_reduce(units(model, setup)[0].numel, 4))
    assert gloo.comm_s > nccl.comm_s
    uneven = simulate_step(model, Setup("zero2", 3, bucket_cap_mb=100), _profile(model), NET, "native")
    numel = units(model, Setup("zero2", 3, bucket_cap_mb=100))[0].numel
    assert numel % 3  # any backend reduces uneven shards with an all-reduce
    scatter = [c for c in uneven.collectives if c.name.startswith("reduce_scatter")][0]
    assert scatter.end_s - scatter.start_s == pytest.approx(_all_reduce(numel, 3))


def test_hybrid_sharding_keeps_gathers_in_the_host_and_all_reduces_shards_across() -> None:
    # 2 hosts x 2 ranks, one slow link per host shared by its ranks: HSDP gathers and
    # reduce-scatters on the fast node link and all-reduces each unit's half-shard across.
    model = _model()
    fast, slow = Link(1e-6, 1e11), Link(1e-4, 1e8)
    net = Network("2x2", fast, slow, 2, "hand-made", shared_net=True)
    prof = _profile(model)
    hsdp = simulate_step(model, Setup("zero3", 4, unit_classes=(nn.Linear,), shard_size=2), prof, net)
    zero3 = simulate_step(model, Setup("zero3", 4, unit_classes=(nn.Linear,)), prof, net)
    across = [c for c in hsdp.collectives if c.name.startswith("all_reduce")]
    assert len(across) == 8  # one per unit (the root holds no parameters)
    shared = Link(slow.alpha, slow.beta / 2)  # both ranks of a host cross at once
    layer = 256 * 256 + 256
    assert across[0].end_s - across[0].start_s == pytest.approx(
        collective_cost("all_reduce", "ring", layer // 2, 4, 2).predict(shared))
    gather = [c for c in hsdp.collectives if c.name.startswith("all_gather")][0]
    assert gather.end_s - gather.start_s == pytest.approx(collective_cost("all_gather", "ring", layer, 4, 2).predict(fast))
    assert hsdp.exposed_s < zero3.exposed_s and hsdp.comm_s < zero3.comm_s / 2


def test_hybrid_sharding_across_hosts_is_also_replayed_with_both_groups_taking_turns_on_one_link() -> None:
    # 4 hosts x 1 rank, hybrid groups of 2: the shard group's collectives and the replica all-reduces leave a rank
    # over its host's one link. The timeline gives each group a clock of its own; the feature is what one clock for
    # both adds to the step, and shared_wire's share of it is charged.
    from dptrain.planner.simulate import Overheads

    model, slow = _model(), Network("4x1", LINK, Link(1e-4, 1e7), 1, "hand-made")  # communication outlasts compute
    prof, setup = _profile(model), Setup("zero2", 4, shard_size=2)
    apart = simulate_step(model, setup, prof, slow)
    turns = apart.features[12]
    replica = [c for c in apart.collectives if c.name.startswith("all_reduce")]
    shard = [c for c in apart.collectives if not c.name.startswith("all_reduce")]
    assert any(r.start_s < s.end_s and s.start_s < r.end_s for r in replica for s in shard)  # apart, they overlap
    one_wire = simulate_step(model, setup, prof, slow, overheads=Overheads(shared_wire=1.0))
    assert turns > 0 and one_wire.step_s == pytest.approx(apart.step_s + turns)
    half = simulate_step(model, setup, prof, slow, overheads=Overheads(shared_wire=0.5))
    assert half.step_s == pytest.approx(apart.step_s + turns / 2)
    # where the groups do not share a link: pairs inside a host, plain ZeRO, DDP
    assert simulate_step(model, setup, prof, Network("2x2", LINK, Link(1e-4, 1e7), 2, "hand-made")).features[12] == 0
    assert simulate_step(model, Setup("zero2", 4), prof, slow).features[12] == 0
    assert simulate_step(model, Setup("ddp", 4), prof, slow).features[12] == 0


def test_two_link_clocks_on_one_wire_take_turns() -> None:
    from dptrain.planner.layout import Unit
    from dptrain.planner.timeline import LinkClock

    unit = Unit(1000, torch.float32, names=("w",))
    first = LinkClock(lambda kind, u: (1.0, 4000))
    own, shared = LinkClock(lambda kind, u: (2.0, 2000)), LinkClock(lambda kind, u: (2.0, 2000), wire=first)
    assert first.run("reduce_scatter", unit, 0, 0.0) == 1.0
    assert own.run("all_reduce", unit, 0, 0.5) == 2.5  # a link of its own: starts when launched
    assert shared.run("all_reduce", unit, 0, 0.5) == 3.0  # one wire: after the other group's collective
    assert first.free == shared.free == 3.0 and first.run("all_gather", unit, 1, 0.0) == 4.0


def test_flops_profile_counts_the_forward() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)).to("meta")
    x = torch.empty(10, 64, device="meta")
    prof = flops_profile(model, x, lambda m, b: m(b).sum(), flops_per_s=1e6)
    assert prof.forward_s == pytest.approx(2 * 10 * (64 * 32 + 32 * 8) / 1e6)
    assert prof.backward_s == 2 * prof.forward_s
    assert prof.ready["1.weight"] < prof.ready["0.weight"] == 1.0


def test_network_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        custom_link(0, 1e-5)
    with pytest.raises(ValueError, match="unknown network preset 'ethernet'"):
        network("ethernet")
    assert network("loopback").net.duplex is False


@pytest.mark.parametrize("args,message", [
    (["--bandwidth-gbit", "-1"], "bandwidth must be > 0"),
    (["--networks", "ethernet"], "unknown network preset"),
    (["--profile", "flops"], "--device-flops"),
    (["--world-sizes", "2,x"], "comma-separated integers"),
])
def test_simulate_command_refuses_bad_input(args, message) -> None:
    out = CliRunner().invoke(main, ["simulate", *args])
    assert out.exit_code == 2, out.output
    assert message in out.output


def test_simulate_command_with_a_flops_profile(tmp_path) -> None:
    out = CliRunner().invoke(main, ["simulate", "--profile", "flops", "--device-flops", "1e12", "--networks",
                                    "eth-10,nvlink4+ib-ndr", "--world-sizes", "1,16", "--plot",
                                    str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json")])
    assert out.exit_code == 0, out.output
    assert "| eth-10 | 16 |" in out.output
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_a_link_probe_of_all_reduces_and_all_gathers_fits_the_link_that_produced_it() -> None:
    # What dptrain.tune.link_probe writes, made by the cost model from a known link: the
    # fit of the emulated cluster's links (dptrain bench cluster-zero) recovers it.
    from dptrain.tune.calibrate import fit_probe

    true = Link(alpha=4e-4, beta=1.3e8)
    sizes = (16 << 10, 256 << 10, 1 << 20, 4 << 20)
    probe = {"world_size": 4, "seconds": {kind: {str(n): collective_cost(kind, "native", n, 4, 4).predict(true)
                                                 for n in sizes} for kind in ("all_reduce", "all_gather")}}
    for kinds in (("all_reduce",), ("all_reduce", "all_gather")):
        fitted = fit_probe(probe, kinds)
        assert fitted.alpha == pytest.approx(true.alpha, rel=1e-6) and fitted.beta == pytest.approx(true.beta, rel=1e-6)


def test_accumulation_computes_every_micro_step_and_reduces_on_the_last_only() -> None:
    model = _model()
    prof = _profile(model)
    one = simulate_step(model, Setup("ddp", 4, bucket_cap_mb=100), prof, NET)
    three = simulate_step(model, Setup("ddp", 4, bucket_cap_mb=100), prof, NET, accum=3)
    assert three.step_s == pytest.approx(one.step_s + 2 * 0.3)  # two more micro-steps of compute, no communication
    assert len(three.collectives) == len(one.collectives) and three.collectives[0].launched_s == pytest.approx(0.9)
    z3 = Setup("zero3", 4, unit_classes=(nn.Linear,))
    z3_one, z3_two = simulate_step(model, z3, prof, NET), simulate_step(model, z3, prof, NET, accum=2)
    gathers = [sum(c.name.startswith("all_gather") for c in p.collectives) for p in (z3_one, z3_two)]
    reductions = [sum(c.name.startswith("reduce_scatter") for c in p.collectives) for p in (z3_one, z3_two)]
    assert gathers == [16, 32] and reductions == [8, 8]  # ZeRO-3 gathers in every micro-step
    z1 = [simulate_step(model, Setup("zero1", 4), prof, NET, accum=a) for a in (1, 2)]
    assert [len(p.collectives) for p in z1] == [len(z1[0].collectives)] * 2  # gathered once, reduced once
    with pytest.raises(ValueError, match="accum"):
        simulate_step(model, Setup("ddp", 4), prof, NET, accum=0)


def test_calibrated_overheads_add_their_terms_times_the_step_s_features() -> None:
    from dptrain.planner.simulate import Overheads

    model = _model()
    prof = _profile(model)
    setup = Setup("ddp", 4, bucket_cap_mb=0.2)  # a bucket per layer, all but the last overlapping backward
    bare = simulate_step(model, setup, prof, NET)
    n = len(bare.collectives)
    assert bare.features[:4] == (1.0, n, 0.0, 0.0) and bare.overhead_s == 0
    assert 0 < bare.features[4] < sum(c.nbytes for c in bare.collectives)  # the overlapped bytes: not all of them
    assert bare.features[6] == 8 * 65_792 * 4  # DDP steps every parameter
    assert bare.features[5] == sum(c.nbytes for c in bare.collectives) and bare.features[7] == pytest.approx(0.31)
    assert bare.features[8:] == (0.0, 0.0, 0.0, 0.0, 0.0)  # no micro-step accumulates, no codec, no hybrid groups
    o = Overheads(per_step_s=1e-3, per_bucket_s=1e-4, contention_s_per_byte=1e-9, state_s_per_byte=1e-10,
                  compute_slowdown=0.1, per_micro_step_s=1e-2, micro_step_s_per_byte=1e-11)
    with_o = simulate_step(model, setup, prof, NET, overheads=o)
    assert with_o.overhead_s == pytest.approx(1e-3 + n * 1e-4 + 1e-9 * bare.features[4] + 1e-10 * bare.features[6]
                                              + 0.031)
    assert with_o.step_s == pytest.approx(bare.step_s + with_o.overhead_s)
    # ZeRO-1/2's collectives and ZeRO-3's are counted apart
    z2 = simulate_step(model, Setup("zero2", 4), prof, NET)
    assert z2.features[1:4] == (0, len(z2.collectives), 0) and z2.features[6] == bare.features[6] / 4
    z3 = simulate_step(model, Setup("zero3", 4), prof, NET)
    assert z3.features[1:4] == (0, 0, len(z3.collectives))
    # accumulation: 3 micro-steps without reducing; a sharded engine's pass over the full gradients in each
    ddp4 = simulate_step(model, setup, prof, NET, accum=4, overheads=o)
    assert ddp4.features[8:10] == (3.0, 0.0) and ddp4.features[7] == pytest.approx(4 * 0.3 + 0.01)
    z2a = simulate_step(model, Setup("zero2", 4), prof, NET, accum=4, overheads=o)
    assert z2a.features[8:12] == (3.0, 3.0 * bare.features[6], 0.0, 0.0)
    z1a = simulate_step(model, Setup("zero1", 4), prof, NET, accum=4)  # fp32 ZeRO-1 accumulates in place
    assert z1a.features[8:10] == (3.0, 0.0)
    z1bf = simulate_step(model, Setup("zero1", 4, precision="bf16"), prof, NET, accum=4)  # into fp32 of its own
    assert z1bf.features[9] == 3.0 * bare.features[6]
    # hybrid sharding: the replica all-reduces count by their bytes, not as the shard group's collectives
    hy = simulate_step(model, Setup("zero2", 4, shard_size=2), prof, NET)
    replica = [c for c in hy.collectives if c.name.startswith("all_reduce")]
    assert replica and hy.features[2] == len(hy.collectives) - len(replica)
    assert hy.features[5] == sum(c.nbytes for c in hy.collectives)
    # ... and a shard group inside one host counts each of its collectives by its ring rounds' share, (2-1)/(4-1);
    # across hosts (NET: one rank a host) or the whole world's group, each counts 1
    two_by_two = Network("2x2", LINK, LINK, 2, "hand-made", shared_net=True)
    inside = simulate_step(model, Setup("zero2", 4, shard_size=2), prof, two_by_two)
    shard_calls = len([c for c in inside.collectives if not c.name.startswith("all_reduce")])
    assert inside.features[2] == pytest.approx(shard_calls / 3) and shard_calls == hy.features[2]
    world = simulate_step(model, Setup("zero2", 4), prof, two_by_two)
    assert world.features[2] == len(world.collectives)
    # the bytes on the network: a pair inside a host sends none across, its replica all-reduces do; on one host
    # (NET's pairs span two hosts; one_host's world is in one) every collective's bytes count
    across = sum(c.nbytes for c in inside.collectives if c.name.startswith("all_reduce"))
    assert 0 < inside.features[5] == across < sum(c.nbytes for c in inside.collectives)
    assert world.features[5] == sum(c.nbytes for c in world.collectives)
    one_host = simulate_step(model, Setup("zero2", 4, shard_size=2), prof,
                             Network("1x4", LINK, LINK, 4, "hand-made"))
    assert one_host.features[5] == sum(c.nbytes for c in one_host.collectives)
    # a codec: every bucket coded, the bytes before encoding (the wire's are half)
    coded = simulate_step(model, setup, prof, NET, compression=2, overheads=Overheads(per_coded_bucket_s=1e-4,
                                                                                      coded_s_per_byte=1e-10))
    assert coded.features[10:12] == (n, bare.features[6]) and coded.features[5] == pytest.approx(bare.features[5] / 2)
    assert coded.overhead_s == pytest.approx(n * 1e-4 + 1e-10 * bare.features[6])
    alone = simulate_step(model, Setup("ddp", 1, bucket_cap_mb=0.2), prof, NET, compression=2)
    assert alone.features[10:12] == (n, bare.features[6])  # one rank still encodes and decodes every bucket
    z2o = simulate_step(model, Setup("zero2", 4), prof, NET, overheads=o)
    extra = z2a.overhead_s - z2o.overhead_s - 0.1 * 3 * 0.3 - 1e-9 * (z2a.features[4] - z2o.features[4])
    assert extra == pytest.approx(3e-2 + 3e-11 * bare.features[6])


def test_simulate_with_a_calibration_uses_its_links_and_overheads_and_models_accumulation(tmp_path) -> None:
    from dptrain.planner.calibration import Calibration
    from dptrain.planner.simulate import Overheads

    path = tmp_path / "calibration.json"
    Calibration("a test machine", "2026-11-28", 1, 8, "gloo", False, Link(1e-4, 1e9), Link(1e-4, 1e9),
                Overheads(per_step_s=5.0)).save(path)
    args = ["simulate", "--profile", "flops", "--device-flops", "1e12", "--world-sizes", "2,4",
            "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=2", "--json", str(tmp_path / "s.json")]
    out = CliRunner().invoke(main, [*args, "--calibration", str(path)])
    assert out.exit_code == 0, out.output
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert {r["network"] for r in rows} == {"calibrated: a test machine"}
    assert all(r["step_s"] > 5.0 for r in rows)  # the 5 s per step of the calibration's overheads
    assert {r["world_size"]: r["global_batch"] for r in rows} == {2: 8, 4: 8}  # 2 ranks accumulate 2 micro-steps
    path.write_text("{}")
    out = CliRunner().invoke(main, [*args, "--calibration", str(path)])
    assert out.exit_code == 2 and "not a dptrain calibration" in out.output
