"""The strategy registry: each entry's facts hold for the wrapper it builds, and unknown names get a did-you-mean."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.strategies import REGISTRY, get_strategy, strategy_names
from dptrain.testing import run_on_ranks

pytestmark = pytest.mark.timeout(120)


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"'zer3' \(did you mean 'zero3'\?\)"):
        get_strategy("zer3")
    with pytest.raises(ValueError, match="choose one of ddp, zero1"):
        get_strategy("gossip", among=strategy_names(lambda s: s.zero_stage is not None))


def test_the_planner_strategies_are_the_replicated_and_zero_ones():
    assert strategy_names(lambda s: s.zero_stage is not None) == ("ddp", "zero1", "zero2", "zero3")
    assert [REGISTRY[n].zero_stage for n in ("ddp", "zero1", "zero2", "zero3")] == [0, 1, 2, 3]


def _wrap_each(rank, world_size, names):
    facts = {}
    for name in names:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        before = {id(p) for p in model.parameters()}
        wrapped = REGISTRY[name].wrap(model)
        wrapped(torch.randn(4, 8)).sum().backward()
        after = {id(p) for p in wrapped.parameters()}
        facts[name] = after != before  # the wrapper replaced the parameters by shards
    return facts


def test_shards_parameters_is_what_each_wrapper_does():
    names = strategy_names(lambda s: s.wrap is not None)
    replaced = run_on_ranks(_wrap_each, 2, names)[0]
    assert replaced == {n: REGISTRY[n].shards_parameters for n in names}


def _protocol_each(rank, world_size, names):
    """Each wrapper through the protocol only: skip a reduction, reduce again, and the pre-step hook."""
    from dptrain.strategies.protocol import DataParallelWrapper, MeetingWrapper

    facts = {}
    for name in names:
        torch.manual_seed(0)
        wrapped = REGISTRY[name].wrap(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
        wrapped.record_comm_spans(True)
        wrapped(torch.randn(4, 8)).sum().backward()
        synced = wrapped.last_step_comm
        wrapped.set_requires_gradient_sync(False)
        wrapped(torch.randn(4, 8)).sum().backward()
        skipped = wrapped.last_step_comm is synced  # no reduction in that backward
        wrapped.set_requires_gradient_sync(True)
        wrapped(torch.randn(4, 8)).sum().backward()
        reduced = synced is None or wrapped.last_step_comm is not synced
        mixes_before = getattr(wrapped, "steps", 0)
        wrapped.before_optimizer_step()
        facts[name] = (isinstance(wrapped, DataParallelWrapper), synced is not None, skipped, reduced,
                       getattr(wrapped, "steps", 0) - mixes_before, isinstance(wrapped, MeetingWrapper))
    return facts


# Whose backward reduces gradients (the others keep their own: gossip mixes before the step, local SGD without a
# warm-up and DiLoCo step alone), and who acts before the optimizer step (gossip's mix, counted in its steps).
REDUCES = {"ddp": True, "zero1": True, "zero2": True, "zero3": True, "gossip": False, "localsgd": False,
           "diloco": False}
MIXES_BEFORE_STEP = {"gossip"}


def test_every_wrapper_satisfies_the_protocol_through_its_switch_stats_and_pre_step_hook():
    names = strategy_names(lambda s: s.wrap is not None)
    assert set(names) == set(REDUCES), "a new strategy: say here what its backward does"
    facts = run_on_ranks(_protocol_each, 2, names)[0]
    for name in names:
        # live recovery holds the meetings of the wrappers whose entry says so, through their meeting protocol
        assert facts[name] == (True, REDUCES[name], True, True, int(name in MIXES_BEFORE_STEP),
                               REGISTRY[name].live == "meeting"), name
