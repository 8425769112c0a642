"""ZeRO mixed precision, global-norm clipping and non-finite steps.

The oracle is mixed precision written out by hand on an unsharded replica: a bf16 copy
of the model computes each rank's micro-batch, its gradients are cast to fp32 and
averaged with one all-reduce, an fp32 master copy takes the Adam step and is cast back
to bf16 for the next forward. With an fp32 reduce, ZeRO must match it to fp32 rounding
(only the order of the gradient sums differs) at every stage and world size.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _models import Layer, build, global_batch, loss_fn
from dptrain import comm
from dptrain.testing import run_on_ranks
from dptrain.zero import MixedPrecision, ZeRO
from dptrain.zero.memory import live_tensor_bytes, state_bytes, zero_formula

STEPS, MICRO = 6, 3
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)


def _zero_kw(stage: int) -> dict:
    return {"unit_classes": (Layer,)} if stage == 3 else {"bucket_cap_mb": 0.001}


def _oracle_step(compute: nn.Module, master: list[torch.Tensor], opt, x, y) -> None:
    for p in compute.parameters():
        p.grad = None
    loss_fn("stack", compute(x.bfloat16()).float(), y).backward()
    for p, m in zip(compute.parameters(), master, strict=True):
        g = p.grad.float()
        dist.all_reduce(g)
        m.grad = g / dist.get_world_size()
    opt.step()
    with torch.no_grad():
        for p, m in zip(compute.parameters(), master, strict=True):
            p.copy_(m)


def _parity(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = build("stack")
    compute = copy.deepcopy(model).bfloat16()
    master = [p.detach().clone().requires_grad_() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    opt_ref = torch.optim.Adam(master, lr=0.01)
    zero = ZeRO(model, stage=stage, mixed_precision=BF16, **_zero_kw(stage))
    opt = torch.optim.Adam(zero.parameters(), lr=0.01)
    seen: dict[str, set] = {"compute": set(), "shard": set(), "grad": set(), "state": set(), "output": set()}
    zero.module.layers[0].fc.register_forward_hook(lambda m, a, o: seen["compute"].update({m.weight.dtype, o.dtype}))
    worst = 0.0
    for step in range(STEPS):
        x, y = global_batch("stack", step, MICRO * world_size)
        x, y = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        _oracle_step(compute, master, opt_ref, x, y)
        opt.zero_grad(set_to_none=True)
        out = zero(x)
        seen["output"].add(out.dtype)
        loss_fn("stack", out, y).backward()
        opt.step()
        got = zero.gathered_state()
        for name, ref in zip(names, master, strict=True):
            worst = max(worst, ((got[name] - ref.detach()).abs().max() / ref.detach().abs().max()).item())
    for unit in zero.units:
        seen["shard"].add(unit.shard.dtype)
        seen["grad"].add(unit.shard.grad.dtype)
        seen["state"].update(v.dtype for v in opt.state[unit.shard].values() if v.dim())
        assert unit.compute_dtype == torch.bfloat16
    return {"worst": worst, **{k: sorted(map(str, v)) for k, v in seen.items()}}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_compute_fp32_master_matches_hand_written_mixed_precision(stage: int, world_size: int) -> None:
    for rank, got in enumerate(run_on_ranks(_parity, world_size, stage, timeout=120)):
        assert got["worst"] < 1e-5, (rank, got)  # measured: 0 (sums of 2-3 bf16 values are exact in fp32)
        assert got["shard"] == got["grad"] == got["state"] == ["torch.float32"], got
        assert got["output"] == ["torch.float32"], got
        assert got["compute"] == ["torch.bfloat16"], got


def _reduce_bytes(rank: int, world_size: int, reduce_dtype: torch.dtype) -> tuple[int, float]:
    torch.manual_seed(0)
    model = build("stack")
    traffic = comm.Traffic()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    zero = ZeRO(model, stage=2, algorithm="ring", traffic=traffic, mixed_precision=mp, bucket_cap_mb=0.001)
    x, y = global_batch("stack", 0, 2 * world_size)
    loss_fn("stack", zero(x[2 * rank:2 * rank + 2]).float(), y[2 * rank:2 * rank + 2]).backward()
    return traffic.bytes_sent, zero.clip_grad_norm_(math.inf).item()


def test_bf16_reduce_sends_half_the_gradient_bytes_of_fp32() -> None:
    fp32 = run_on_ranks(_reduce_bytes, 2, torch.float32, timeout=60)
    bf16 = run_on_ranks(_reduce_bytes, 2, torch.bfloat16, timeout=60)
    for rank in range(2):
        assert bf16[rank][0] * 2 == pytest.approx(fp32[rank][0], rel=0.01), (fp32, bf16)
        assert bf16[rank][1] == pytest.approx(fp32[rank][1], rel=2e-2)  # the same gradient, rounded


def _clip(rank: int, world_size: int, stage: int, poison: bool) -> dict:
    torch.manual_seed(0)
    model = build("stack")
    reference = copy.deepcopy(model)
    zero = ZeRO(model, stage=stage, **_zero_kw(stage))
    x, y = global_batch("stack", 0, 2 * world_size)
    if poison and rank == world_size - 1:
        x = x.clone()
        x[2 * rank, 0] = math.inf  # one rank's batch makes every gradient non-finite after the average
    mine = slice(2 * rank, 2 * rank + 2)
    loss_fn("stack", zero(x[mine]), y[mine]).backward()
    norm = zero.clip_grad_norm_(0.5).item()
    out = {"norm": norm}
    if not poison:
        loss_fn("stack", reference(x), y).backward()  # the global batch on one replica: the whole gradient
        out["expected"] = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item()
        clipped = {n: p.grad for n, p in reference.named_parameters()}
        worst = 0.0
        for unit in zero.units:
            expected = torch.cat([clipped[r.name].reshape(-1) for r in unit.refs])[unit.lo:unit.hi]
            if expected.numel():
                worst = max(worst, ((unit.shard.grad - expected).abs().max() / expected.abs().max()).item())
        out["worst"] = worst
        local = sum(u.shard.grad.pow(2).sum().item() for u in zero.units if u.shard.grad is not None)
        out["local_after"] = local
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_norm_uses_the_norm_over_every_shard(stage: int) -> None:
    got = run_on_ranks(_clip, 3, stage, False, timeout=60)
    for rank, out in enumerate(got):
        assert out["norm"] == pytest.approx(out["expected"], rel=1e-5), (rank, out)
        assert out["norm"] > 0.5  # so clipping really scaled something
        assert out["worst"] < 1e-5, (rank, out)
    # after clipping, the shards' squares add up to max_norm^2 over all ranks, not on one
    assert sum(o["local_after"] for o in got) == pytest.approx(0.25, rel=1e-4)
    assert all(o["local_after"] < 0.25 for o in got)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_non_finite_gradient_on_one_rank_gives_every_rank_a_non_finite_norm(stage: int) -> None:
    got = run_on_ranks(_clip, 3, stage, True, timeout=60)
    assert all(not math.isfinite(o["norm"]) for o in got), got


def _memory(rank: int, world_size: int, stage: int, reduce_dtype: torch.dtype) -> dict:
    x, y = torch.randn(4, 256), torch.randn(4, 1)
    before = live_tensor_bytes()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)], nn.Linear(256, 1))
    numel = sum(p.numel() for p in model.parameters())
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, output_dtype=torch.float32)
    zero = ZeRO(model, stage=stage, mixed_precision=mp, unit_classes=(nn.Sequential,) if stage == 3 else ())
    del model
    opt = torch.optim.Adam(zero.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(zero(x), y).backward()
        opt.step()
    return {"numel": numel, "live": live_tensor_bytes(settle_s=0.1) - before, **state_bytes(zero, opt)}


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_bytes_per_rank_equal_the_formulas(stage: int, reduce_dtype: torch.dtype) -> None:
    world_size = 2
    r = reduce_dtype.itemsize
    for rank, got in enumerate(run_on_ranks(_memory, world_size, stage, reduce_dtype, timeout=120)):
        expected = zero_formula(stage, got["numel"], world_size, param_bytes=2, reduce_bytes=r)
        assert got["live"] == pytest.approx(expected, rel=0.02), (rank, got, expected)
        psi, n = got["numel"], world_size
        params = {1: 2 * psi + 4 * psi / n, 2: 2 * psi + 4 * psi / n, 3: 4 * psi / n}[stage]
        assert got["parameters"] == pytest.approx(params, rel=0.02), (rank, got)
        assert got["optimizer"] == pytest.approx(8 * psi / n, rel=0.02), (rank, got)
