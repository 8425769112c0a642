"""Delay compensation by look-ahead: the prediction is the optimizer's next step, and it reaches the workers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.ps import Consistency, Lookahead
from dptrain.testing import RankFailedError, run_on_ranks
from test_ps import _model, _ps

pytestmark = pytest.mark.timeout(120)


def _flat_params(model: nn.Module) -> tuple[torch.Tensor, nn.ParameterList]:
    """The model's parameters as views of one flat buffer, as a server holds them."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    views, offset = nn.ParameterList(), 0
    for p in model.parameters():
        views.append(nn.Parameter(flat[offset:offset + p.numel()].view(p.shape)))
        offset += p.numel()
    return flat, views


def _grads(views: nn.ParameterList, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in views]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_lookahead_is_the_next_step_when_the_momentum_direction_does_not_change(kind):
    """AdamW with beta1 = beta2 = 0 repeats its step for a repeated gradient, and SGD's momentum buffer is
    unchanged by a gradient of (1 - momentum) x buffer: then one step of the optimizer lands exactly where
    the look-ahead with an expected delay of 1 said."""
    flat, views = _flat_params(_model())
    if kind == "adamw":
        opt = torch.optim.AdamW(views, lr=0.01, betas=(0.0, 0.0), weight_decay=0.1)
    else:
        opt = torch.optim.SGD(views, lr=0.01, momentum=0.9, weight_decay=0.1)
    look = Lookahead(opt, views, flat, workers=[0, 1])
    assert look.expected == {0: 1.0, 1: 1.0}  # round-robin arrivals: one other update in between
    grads = _grads(views, 0)
    for p, g in zip(views, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    if kind == "adamw":
        next_grads = grads
    else:  # momentum x buf + (1 - momentum) x buf + decay x theta = buf: the grad is cleared of the decay term
        next_grads = [0.1 * opt.state[p]["momentum_buffer"] - 0.1 * p.detach() for p in views]
    predicted = look.predict(0, lr=0.01, version=1).clone()
    for p, g in zip(views, next_grads, strict=True):
        p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(predicted, flat, rtol=1e-5, atol=1e-7)


def test_no_state_or_no_delay_sends_the_parameters_themselves():
    flat, views = _flat_params(_model())
    opt = torch.optim.Adam(views, lr=0.01)
    look = Lookahead(opt, views, flat, workers=[0, 1, 2])
    assert torch.equal(look.predict(0, lr=0.01, version=0), flat)  # no optimizer state yet
    for p, g in zip(views, _grads(views, 1), strict=True):
        p.grad = g
    opt.step()
    for _ in range(60):
        look.observe(1, 0)
    assert look.expected[1] < 1e-5 and look.expected[0] == 2.0
    assert torch.allclose(look.predict(1, lr=0.01, version=1), flat, atol=1e-6)
    assert not torch.allclose(look.predict(0, lr=0.01, version=1), flat, atol=1e-4)


def test_lookahead_refuses_an_optimizer_it_cannot_predict():
    flat, views = _flat_params(_model())
    with pytest.raises(ValueError, match="the optimizer is RMSprop"):
        Lookahead(torch.optim.RMSprop(views), views, flat, workers=[0])


def test_async_workers_receive_the_looked_ahead_parameters():
    """The same async job with and without look-ahead: the run completes with every gradient recorded, and
    what the workers computed on moved."""
    with_look = run_on_ranks(_ps, 3, 1, Consistency("async"), 6, lookahead=True)
    without = run_on_ranks(_ps, 3, 1, Consistency("async"), 6)
    report, records = with_look[2]
    assert report["gradients"] == len(records) == 12
    assert len(with_look[0][0]) + len(with_look[1][0]) >= 12  # and a push that came after the budget
    assert not torch.allclose(with_look[0][0][-1], without[0][0][-1])


def test_lookahead_in_a_round_mode_is_refused():
    with pytest.raises(RankFailedError, match="in sync mode every applied gradient is fresh"):
        run_on_ranks(_ps, 2, 1, Consistency("sync"), 2, lookahead=True)
