"""DGC's remedies for top-k (compress/dgc.py) against their formulas, written out, on fixed tensors."""

from __future__ import annotations

import pytest
import torch

from dptrain.compress.codecs import TopK
from dptrain.compress.dgc import MomentumCorrection, clip_local, warmup_fraction

GRADS = [torch.tensor([0.5, -2.0, 0.1, 0.3, -0.2, 1.0, 0.05, -0.4]),
         torch.tensor([0.4, 0.1, -0.3, 2.5, 0.2, -0.1, 0.6, 0.0]),
         torch.tensor([-0.1, 0.2, 0.9, 0.1, -1.5, 0.3, -0.2, 0.7])]


def _reference(grads, momentum, k, masking):
    """DGC eq. 5-6 with top-k, one step at a time, in plain Python lists."""
    n = len(grads[0])
    u, v, sent_all = [0.0] * n, [0.0] * n, []
    for g in grads:
        u = [momentum * ui + gi for ui, gi in zip(u, g.tolist(), strict=True)]
        v = [vi + ui for vi, ui in zip(v, u, strict=True)]
        top = sorted(range(n), key=lambda i: -abs(v[i]))[:k]
        sent = [v[i] if i in top else 0.0 for i in range(n)]
        sent_all.append(sent)
        if masking:
            u = [0.0 if i in top else u[i] for i in range(n)]
            v = [0.0 if i in top else v[i] for i in range(n)]
        else:
            v = [vi - si for vi, si in zip(v, sent, strict=True)]
    return sent_all, u, v


@pytest.mark.parametrize("masking", [True, False])
def test_momentum_correction_sends_top_k_of_the_accumulated_velocity(masking):
    codec, dgc = TopK(0.25), MomentumCorrection(0.9, masking=masking)
    sent = [codec.decode(dgc.encode("b", g, codec)) for g in GRADS]
    want, u, v = _reference(GRADS, 0.9, 2, masking)
    for got, expected in zip(sent, want, strict=True):
        torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dgc.velocity["b"], torch.tensor(u), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dgc.accumulated["b"], torch.tensor(v), rtol=1e-6, atol=1e-7)


def test_without_masking_nothing_of_the_velocities_is_lost():
    # sum of what was sent + what is still accumulated = sum of the velocities u_t
    codec, dgc = TopK(0.25), MomentumCorrection(0.5, masking=False)
    total_sent = sum(codec.decode(dgc.encode(0, g, codec)) for g in GRADS)
    u, velocities = torch.zeros(8), torch.zeros(8)
    for g in GRADS:
        u = 0.5 * u + g
        velocities += u
    torch.testing.assert_close(total_sent + dgc.accumulated[0], velocities)


def test_momentum_correction_state_round_trips():
    codec, dgc = TopK(0.25), MomentumCorrection(0.9)
    dgc.encode(3, GRADS[0], codec)
    again = MomentumCorrection(0.9)
    again.load_state_dict(dgc.state_dict())
    a, b = dgc.encode(3, GRADS[1], codec), again.encode(3, GRADS[1], codec)
    assert torch.equal(a.tensors[1], b.tensors[1]) and torch.equal(a.tensors[0], b.tensors[0])


def test_local_clipping_scales_to_max_norm_over_root_n():
    g = torch.tensor([3.0, 4.0])  # norm 5
    clipped = g.clone()
    assert clip_local(clipped, max_norm=2.0, world_size=4) is clipped  # in place
    torch.testing.assert_close(clipped, torch.tensor([0.6, 0.8]))  # limit 2/sqrt(4) = 1: g / 5
    assert clip_local(g, max_norm=20.0, world_size=4) is g  # limit 10: untouched
    assert g.tolist() == [3.0, 4.0]


def test_sparsity_warmup_falls_by_four_per_stage_to_the_target():
    # 25% -> 1%: 25, 6.25, 1.5625 (3 stages over the warm-up), then the target
    fractions = [warmup_fraction(s, 0.01, 99) for s in (0, 32, 33, 65, 66, 98, 99, 500)]
    assert fractions == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01]
    assert warmup_fraction(0, 0.01, 0) == 0.01
    with pytest.raises(ValueError, match="target"):
        warmup_fraction(0, 0.5, 10, start=0.25)
