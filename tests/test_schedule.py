"""LR scaling rules and the warmup-cosine schedule."""

import math
from itertools import pairwise

import pytest

from dptrain.optim.schedule import scaled_lr, warmup_cosine


def test_scaling_rules():
    assert scaled_lr(1e-3, "none", 256, 32) == 1e-3
    assert scaled_lr(1e-3, "linear", 256, 32) == pytest.approx(8e-3)
    assert scaled_lr(1e-3, "sqrt", 128, 32) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="use none, linear or sqrt"):
        scaled_lr(1e-3, "cubic", 64, 32)


def test_warmup_then_cosine_to_floor():
    lrs = [warmup_cosine(s, 1.0, 10, 110, 0.1) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in pairwise(lrs[:10]))          # rising
    assert all(a >= b for a, b in pairwise(lrs[10:]))          # falling
    assert lrs[-1] == pytest.approx(0.1) and lrs[60] == pytest.approx(0.55, abs=0.01)
    assert warmup_cosine(500, 1.0, 10, 110, 0.1) == pytest.approx(0.1)  # past the end: the floor
    assert all(math.isfinite(warmup_cosine(s, 1.0, 5, 5, 0.0)) for s in range(8))
