"""ZeRO's options as frozen policies: each checks itself, the documented keywords still build them, and
a unit is complete when its constructor returns."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from _models import Layer, build, global_batch, loss_fn
from dptrain.testing import run_on_ranks
from dptrain.zero import CheckPolicy, CommPolicy, MixedPrecision, ShardingPolicy, UnitPolicy, ZeRO
from dptrain.zero.policy import KEYWORDS, ZeROPolicies, resolve_policies


def test_policies_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShardingPolicy().prefetch = False


@pytest.mark.parametrize("make, text", [
    (lambda: UnitPolicy(bucket_cap_mb=0), "bucket_cap_mb must be above 0, got 0"),
    (lambda: UnitPolicy(unit_classes=("Block",)), "unit_classes must be module classes, got ['Block']"),
    (lambda: ShardingPolicy(shard_size=0), "shard_size must be a rank count of at least 1"),
    (lambda: CheckPolicy(collectives="always"), "check_collectives='always': expected one of off, first, every"),
    (lambda: CheckPolicy(timeout_s=0), "check_timeout_s must be above 0 seconds, got 0"),
    (lambda: CommPolicy(compression="int8"), "compression must be a dptrain.compress.zero.ShardedCompression"),
    (lambda: ZeROPolicies(mixed_precision=torch.bfloat16), "mixed_precision must be a dptrain.zero.MixedPrecision"),
])
def test_each_policy_names_its_bad_value_when_built(make, text: str) -> None:
    with pytest.raises((ValueError, TypeError), match=text.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_every_documented_keyword_lands_in_its_policy() -> None:
    values = {"unit_classes": (Layer,), "min_unit_numel": 7, "bucket_cap_mb": 1.5, "split_by": len,
              "shard_size": 2, "reshard_after_forward": False, "prefetch": False, "find_unused_parameters": True,
              "algorithm": "ring", "nodes": 2, "traffic": None, "compression": None, "broadcast_buffers": False,
              "check_collectives": "every", "check_timeout_s": 9.0, "device": "cpu", "init_fn": print}
    assert set(values) == set(KEYWORDS)
    policies = resolve_policies({}, values)
    for keyword, (policy, name) in KEYWORDS.items():
        assert getattr(getattr(policies, policy), name) == values[keyword], keyword


def test_a_keyword_beside_its_policy_replaces_that_field_only() -> None:
    policies = resolve_policies({"sharding": ShardingPolicy(shard_size=2, prefetch=False)},
                                {"reshard_after_forward": False})
    assert policies.sharding == ShardingPolicy(shard_size=2, prefetch=False, reshard_after_forward=False)
    assert not policies.sharding.reshards


def test_find_unused_parameters_turns_prefetch_and_resharding_off() -> None:
    sharding = ShardingPolicy(find_unused_parameters=True)
    assert sharding.prefetch and not sharding.prefetches and not sharding.reshards


def test_a_mistyped_keyword_is_refused_with_the_close_names() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefech'; did you mean 'prefetch'"):
        resolve_policies({}, {"prefech": False})


def _same_wrapper(rank: int, world_size: int) -> list:
    mp = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    old = ZeRO(build("stack"), stage=3, unit_classes=(Layer,), prefetch=False, algorithm="ring",
               check_collectives="off", mixed_precision=mp)
    torch.manual_seed(0)
    new = ZeRO(build("stack"), stage=3, units=UnitPolicy(unit_classes=(Layer,)),
               sharding=ShardingPolicy(prefetch=False), communication=CommPolicy(algorithm="ring"),
               checks=CheckPolicy(collectives="off"), mixed_precision=mp)
    assert old.policies == new.policies and not new.prefetch and new.collective_check is None
    losses = []
    for model in (old, new):
        x, y = global_batch("stack", rank, 2)
        loss = loss_fn("stack", model(x), y)
        loss.backward()
        losses.append(loss.item())
        assert all(u.shard.grad is not None for u in model.units)
    return [losses, [(u.index, u.numel, u.owner is not None, u.key) for u in new.units]]


def test_policies_and_keywords_build_the_same_wrapper() -> None:
    for losses, units in run_on_ranks(_same_wrapper, 2, timeout=60):
        assert losses[0] == losses[1]
        assert [owned for _, _, owned, _ in units].count(True) >= 2, units


def _units_complete(rank: int, world_size: int) -> list[dict]:
    model = ZeRO(build("stack"), stage=3, unit_classes=(Layer,), find_unused_parameters=True)
    layers = [m for m in model.module.modules() if isinstance(m, Layer)]
    return [dict(owner=layers.index(u.owner) if u.owner is not None else None, key=u.key, defer=u.defer,
                 single_piece=u.single_piece, shared=u.context is model._context,
                 reshard=u.reshard_after_forward) for u in model.units]


def test_a_unit_is_complete_when_built() -> None:
    # owner, key, the shared context and the find_unused_parameters state all come from FlatUnit's constructor
    units = run_on_ranks(_units_complete, 1, timeout=60)[0]
    assert [u["owner"] for u in units if u["owner"] is not None] == list(range(len(units) - 1))
    assert all(u["defer"] and u["single_piece"] is False and u["shared"] and not u["reshard"] for u in units)


def test_unit_policy_refuses_unit_modules_below_stage_3() -> None:
    with pytest.raises(ValueError, match="stage 2 shards buckets"):
        UnitPolicy(unit_classes=(nn.Linear,)).check_stage(2)
