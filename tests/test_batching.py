"""global_batch = micro_batch x world_size x grad_accum_steps: any two give the third."""

import pytest

from dptrain import BatchPlan, BatchSizeError


@pytest.mark.parametrize("given,expected", [
    (dict(global_batch_size=64, micro_batch_size=8), (64, 8, 2)),
    (dict(global_batch_size=64, grad_accum_steps=4), (64, 4, 4)),
    (dict(micro_batch_size=8, grad_accum_steps=3), (96, 8, 3)),
    (dict(global_batch_size=64), (64, 16, 1)),
    (dict(micro_batch_size=5), (20, 5, 1)),
    (dict(global_batch_size=64, micro_batch_size=4, grad_accum_steps=4), (64, 4, 4)),
])
def test_any_two_determine_the_third(given, expected):
    plan = BatchPlan.resolve(world_size=4, **given)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == expected
    assert plan.global_batch_size == plan.micro_batch_size * plan.world_size * plan.grad_accum_steps


def test_inconsistent_sizes_show_the_arithmetic_and_fixes():
    with pytest.raises(BatchSizeError) as error:
        BatchPlan.resolve(world_size=4, global_batch_size=64, micro_batch_size=6, grad_accum_steps=1)
    assert str(error.value) == ("global batch 64 != micro 6 x accum 1 x world 4 = 24; "
                                "choose micro_batch_size 16, or global_batch_size 24")


def test_global_not_a_multiple_of_micro_times_world():
    with pytest.raises(BatchSizeError, match=r"64 is not a multiple of micro 6 x world 4 = 24.*"
                                             r"choose global_batch_size 48 or 72, or micro_batch_size 4 or 8"):
        BatchPlan.resolve(world_size=4, global_batch_size=64, micro_batch_size=6)


def test_global_not_divisible_by_world():
    with pytest.raises(BatchSizeError, match=r"global batch 10 is not divisible by accum 1 x world 4 = 4.*"
                                             r"choose global_batch_size 8 or 12"):
        BatchPlan.resolve(world_size=4, global_batch_size=10)


@pytest.mark.parametrize("bad", [dict(global_batch_size=0), dict(micro_batch_size=-2),
                                 dict(micro_batch_size=2.5), dict(grad_accum_steps=2)])
def test_missing_or_non_positive_sizes_are_refused(bad):
    with pytest.raises(BatchSizeError):
        BatchPlan.resolve(world_size=2, **bad)
