"""Parity: ZeRO stages 1-3 step exactly like the DDP engine, Adam, fp32, world sizes 1-4.

Both wrappers train side by side on every rank from the same initial parameters, each
rank on its own micro-batch of the step's global batch; after every one of 10 Adam
steps the ZeRO model's gathered parameters are compared with the DDP model's, and
before every step each rank's gradient shard with its slice of DDP's averaged gradient
(Adam is invariant to the gradients' scale, so parameters alone would not catch a
missing division by the world size). The
main test uses ``stack13`` (757 parameters, a prime) and checks that some unit's size is
not divisible by the world size, so that shards are really uneven at every world size.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _models import Layer, build, global_batch, loss_fn
from dptrain import DistributedDataParallel
from dptrain.models.gpt import Block
from dptrain.testing import run_on_ranks
from dptrain.zero import MixedPrecision, ZeRO

STEPS, MICRO, TOLERANCE = 10, 3, 1e-5


def _optimizer(model_name: str, params) -> torch.optim.Optimizer:
    # The GPT's attention key bias has a true gradient of exactly zero (softmax ignores a
    # shift of all scores), so what it gets is rounding noise, which differs with the
    # order ranks' gradients are summed in; Adam divides by its magnitude and turns it
    # into lr-sized steps of random sign (1e-4 relative after 2 steps at 3 ranks, while
    # SGD stays at 3e-7). The GPT cases therefore use SGD with momentum.
    if model_name == "gpt":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _parity(rank: int, world_size: int, model_name: str, stage: int, zero_kw: dict, accum: int) -> float:
    torch.manual_seed(0)
    model = build(model_name)
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.0004)
    zero = ZeRO(model, stage=stage, **zero_kw)
    opt_ddp, opt_zero = _optimizer(model_name, ddp.parameters()), _optimizer(model_name, zero.parameters())
    worst = 0.0
    for step in range(STEPS):
        x, y = global_batch(model_name, step, MICRO * world_size * accum)
        for wrapper, opt in ((ddp, opt_ddp), (zero, opt_zero)):
            opt.zero_grad(set_to_none=True)
            for micro in range(accum):
                lo = (micro * world_size + rank) * MICRO
                sync = wrapper.no_sync() if micro < accum - 1 else torch.enable_grad()
                with sync:
                    (loss_fn(model_name, wrapper(x[lo:lo + MICRO]), y[lo:lo + MICRO]) / accum).backward()
        worst = max(worst, _gradient_diff(ddp, zero))  # Adam alone would not see a wrong gradient scale
        opt_ddp.step()
        opt_zero.step()
        got = zero.gathered_state()
        for name, ref in ddp.module.named_parameters():
            worst = max(worst, _relative(got[name], ref.detach()))
    return worst


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _gradient_diff(ddp: DistributedDataParallel, zero: ZeRO) -> float:
    """Each rank's shard gradient against its slice of the DDP engine's averaged gradient."""
    grads = {name: p.grad for name, p in ddp.module.named_parameters()}
    worst = 0.0
    for unit in zero.units:
        expected = torch.cat([grads[r.name].reshape(-1) for r in unit.refs])[unit.lo:unit.hi]
        got = unit.shard.grad if unit.shard.grad is not None else torch.zeros_like(expected)
        if expected.numel():
            worst = max(worst, ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item())
    return worst


CASES = {
    "stage1": ("mlp", 1, {"bucket_cap_mb": 0.0004}, 1),
    "stage2": ("mlp", 2, {"bucket_cap_mb": 0.0004}, 1),
    "stage3_units": ("stack", 3, {"unit_classes": (Layer,)}, 1),
    "stage3_keep_after_forward": ("stack", 3, {"unit_classes": (Layer,), "reshard_after_forward": False}, 1),
    "stage3_no_prefetch": ("stack", 3, {"unit_classes": (Layer,), "prefetch": False}, 1),
    "stage3_auto_wrap": ("stack", 3, {"min_unit_numel": 100}, 1),
    # wte and lm_head share a weight and are different units: it must go to the root unit.
    "stage3_tied_across_units": ("gpt", 3, {"unit_classes": (torch.nn.Embedding, torch.nn.Linear)}, 1),
    "stage3_gpt_blocks": ("gpt", 3, {"unit_classes": (Block,)}, 1),
    # the embedding is a unit of its own and the parent reads its weight for the output head
    "stage3_tied_head_read_by_the_parent": ("tied", 3, {"unit_classes": (torch.nn.Embedding, torch.nn.Linear)}, 1),
    "stage3_tied_head_read_by_the_parent_accumulation": ("tied", 3, {"unit_classes": (torch.nn.Embedding,)}, 2),
    "stage2_tied": ("tied", 2, {"bucket_cap_mb": 0.0004}, 1),
    "stage1_accumulation": ("mlp", 1, {"bucket_cap_mb": 0.0004}, 2),
    # a shared weight's gradient arrives in pieces: stage 1 must learn to reduce after backward
    "stage1_reentrant_checkpointing": ("ckpt_reentrant", 1, {"bucket_cap_mb": 0.0004}, 1),
    "stage1_checkpointing": ("ckpt_nonreentrant", 1, {"bucket_cap_mb": 0.0004}, 2),
    "stage2_reentrant_checkpointing": ("ckpt_reentrant", 2, {"bucket_cap_mb": 0.0004}, 1),
    "stage2_accumulation": ("mlp", 2, {"bucket_cap_mb": 0.0004}, 2),
    "stage3_accumulation": ("stack", 3, {"unit_classes": (Layer,)}, 2),
    "stage2_ring": ("stack", 2, {"algorithm": "ring"}, 1),
    "stage3_tree": ("stack", 3, {"unit_classes": (Layer,), "algorithm": "tree"}, 1),
}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_matches_ddp_after_every_adam_step(stage: int, world_size: int) -> None:
    kw = {"bucket_cap_mb": 0.0004} if stage < 3 else {"unit_classes": (Layer,)}
    worst = run_on_ranks(_parity, world_size, "stack13", stage, kw, 1, timeout=120)
    assert max(worst) <= TOLERANCE, worst
    if world_size > 1:
        sizes = run_on_ranks(_unit_sizes, 1, stage, kw, timeout=60)[0]
        assert any(size % world_size for size in sizes), sizes  # uneven shards exist


def _unit_sizes(rank: int, world_size: int, stage: int, kw: dict) -> list[int]:
    return [unit.numel for unit in ZeRO(build("stack13"), stage=stage, **kw).units]


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero_variants_match_ddp(case: str) -> None:
    model, stage, kw, accum = CASES[case]
    worst = run_on_ranks(_parity, 3, model, stage, kw, accum, timeout=120)
    assert max(worst) <= TOLERANCE, worst


def _decayed_numel(rank: int, world_size: int, stage: int) -> tuple[int, int]:
    from dptrain.optim.build import build_optimizer, decays

    torch.manual_seed(0)
    model = build("gpt")
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    zero = ZeRO(model, stage=stage, split_by=decays, **({"unit_classes": (Block,)} if stage == 3 else {}))
    opt = build_optimizer(zero, "adamw", 1e-2, 0.1, (0.9, 0.99), 0.9)
    return sum(p.numel() for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]), matrices


@pytest.mark.parametrize("stage", [1, 3])
def test_the_trainers_optimizer_decays_zeros_matrix_shards_and_not_the_others(stage: int) -> None:
    """The trainer's AdamW decays matrices only; under ZeRO it reads each shard's unit key (split_by=decays). The key
    was once read after flattening, when every parameter is 1-D, and no ZeRO run decayed anything."""
    decayed, matrices = run_on_ranks(_decayed_numel, 1, stage, timeout=60)[0]
    assert decayed == matrices > 0


def _waits_before_launching(rank: int, world_size: int) -> dict[str, int]:
    """How often one backward waited for an earlier reduction before launching the next, per configuration."""
    from dptrain.zero.reduction import UnitReduction
    counted, settle = [0], UnitReduction.settle_oldest

    def counting(self):
        counted[0] += 1
        settle(self)

    UnitReduction.settle_oldest = counting
    out = {}
    for name, kw in {"stage 1": dict(stage=1), "stage 1, bf16": dict(stage=1, mixed_precision=MixedPrecision(reduce_dtype=torch.float32)),
                     "stage 2": dict(stage=2), "stage 1, hybrid": dict(stage=1, shard_size=1)}.items():
        torch.manual_seed(0)
        model = ZeRO(build("stack13"), bucket_cap_mb=0.0004, **kw)
        x, y = global_batch("stack13", 0, MICRO)
        counted[0] = 0
        loss_fn("stack13", model(x), y).backward()
        out[name] = (counted[0], len(model.units))
    return out


def test_stage1_in_place_launches_every_reduction_without_waiting_for_the_one_before() -> None:
    # A reduction of a temporary gradient (stage 2, a cast stage-1 gradient) waits for the one before it (at most one
    # full-size temporary in flight); stage 1's lasting buffer costs nothing in flight, so none waits (docs/tune.md, the
    # sixteenth pass), except under hybrid sharding, whose settling starts the replicas' all-reduce.
    counts = run_on_ranks(_waits_before_launching, 2, timeout=120)[0]
    assert counts["stage 1"][0] == 0 and counts["stage 1"][1] > 2, counts
    for held in ("stage 1, bf16", "stage 2", "stage 1, hybrid"):
        assert counts[held][0] >= counts[held][1] - 1, (held, counts)
