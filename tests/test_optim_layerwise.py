"""LARS and LAMB: the math against hand-written formulas, and per-layer trust ratios under ZeRO.

The model (:class:`Net`, 265 parameters) has flat units whose sizes are not multiples
of 2 or 3 (stage 3: blocks of 71, a root of 51, a 1-element gain), so at 2 and 3 ranks
weight matrices straddle shard boundaries, some layers have no element on some ranks and
the gain's unit leaves every rank but one with an empty shard. Each ZeRO run trains side
by side with the same optimizer on a plain replica fed the global batch, compared after
every step; the broken variants (a trust ratio per shard, or per-rank pieces of a layer
never summed) are run too, to show that the parity test would catch them.
"""

from __future__ import annotations

import contextlib
import copy
import io
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptrain.comm import shard_bounds
from dptrain.optim import LAMB, LARS, layerwise
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO

STEPS, MICRO, TOLERANCE = 6, 3, 1e-5
LARS_KW = dict(lr=0.1, momentum=0.9, weight_decay=0.01, eta=0.1)
LAMB_KW = dict(lr=0.02, weight_decay=0.01)
COMBOS = [(name, exclude_1d) for name in ("lars", "lamb") for exclude_1d in (False, True)]


class Block(nn.Module):
    """71 parameters: a 7x7 matrix and its bias, a LayerNorm's gain and bias, a 0-d residual scale."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(7, 7)
        self.norm = nn.LayerNorm(7)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, h):
        return h + self.scale * torch.tanh(self.norm(self.fc(h)))


class Gain(nn.Module):
    """One 0-d parameter: under stage 3 a unit of one element, empty on every rank but the first."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.0))

    def forward(self, h):
        return h * self.weight


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 7)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(7, 2)
        self.gain = Gain()

    def forward(self, x):
        h = torch.tanh(self.inp(x))  # (B, 7)
        for block in self.blocks:
            h = block(h)
        return self.gain(self.head(h))  # (B, 2)


ZERO_KW = {1: {"bucket_cap_mb": 0.0004}, 2: {"bucket_cap_mb": 0.0004}, 3: {"unit_classes": (Block, Gain)}}


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 4, generator=g), torch.randn(size, 2, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _optimizer(name: str, params, exclude_1d: bool, **overrides) -> torch.optim.Optimizer:
    if name == "lars":
        return LARS(params, **{**LARS_KW, "exclude_1d": exclude_1d, **overrides})
    return LAMB(params, **{**LAMB_KW, "exclude_1d": exclude_1d, **overrides})


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


# --------------------------------------------------------------------- single process: the math


def _hand_lars(p: torch.Tensor, buf: torch.Tensor, *, lr, momentum, weight_decay, eta, eps, exclude_1d) -> None:
    excluded = exclude_1d and p.dim() <= 1
    wd = 0.0 if excluded else weight_decay
    w_norm, g_norm = p.norm().item(), p.grad.norm().item()
    denom = g_norm + wd * w_norm
    local_lr = 1.0 if excluded or w_norm == 0 or denom == 0 else eta * w_norm / (denom + eps)
    buf.copy_(momentum * buf + lr * local_lr * (p.grad + wd * p))
    p.sub_(buf)


def _hand_lamb(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, *, lr, betas, eps, weight_decay,
               exclude_1d) -> None:
    excluded = exclude_1d and p.dim() <= 1
    wd = 0.0 if excluded else weight_decay
    m.copy_(betas[0] * m + (1 - betas[0]) * p.grad)
    v.copy_(betas[1] * v + (1 - betas[1]) * p.grad ** 2)
    u = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm().item(), u.norm().item()
    trust = 1.0 if excluded or w_norm == 0 or u_norm == 0 else w_norm / u_norm
    p.sub_(lr * trust * u)


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 2))
    with torch.no_grad():
        model[0].bias.zero_()  # ||w|| = 0 on the first step: trust ratio 1
    return model


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("exclude_1d", [False, True])
@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_three_steps_match_the_hand_written_formula(name: str, exclude_1d: bool, weight_decay: float) -> None:
    model = _tiny_model()
    hand = copy.deepcopy(model)
    opt = _optimizer(name, model.parameters(), exclude_1d, weight_decay=weight_decay)
    defaults = {"lars": dict(eps=1e-8), "lamb": dict(betas=(0.9, 0.999), eps=1e-6)}  # as documented
    kw = {**(LARS_KW if name == "lars" else LAMB_KW), **defaults[name], "weight_decay": weight_decay,
          "exclude_1d": exclude_1d}
    state = {p: [torch.zeros_like(p), torch.zeros_like(p)] for p in hand.parameters()}
    for step in range(3):
        x, y = _batch(step, 6)
        for m in (model, hand):
            m.zero_grad(set_to_none=True)
            _loss(m, x, y).backward()
        opt.step()
        with torch.no_grad():
            for p in hand.parameters():
                if name == "lars":
                    _hand_lars(p, state[p][0], **kw)
                else:
                    _hand_lamb(p, *state[p], step + 1, **kw)
        for p, q in zip(model.parameters(), hand.parameters(), strict=True):
            assert _relative(p.detach(), q.detach()) <= 1e-6, (step, p.shape)
    assert any(_relative(p.detach(), q.detach()) > 1e-3 for p, q in zip(model.parameters(), _tiny_model().parameters(), strict=True))


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_state_dict_round_trip_resumes_exactly(name: str) -> None:
    straight, resumed = _tiny_model(), _tiny_model()
    opt_straight, opt = _optimizer(name, straight.parameters(), True), _optimizer(name, resumed.parameters(), True)
    for step in range(4):
        if step == 2:  # a fresh optimizer (with a wrong lr) takes over from a saved state dict
            saved = io.BytesIO()
            torch.save(opt.state_dict(), saved)
            saved.seek(0)
            opt = _optimizer(name, resumed.parameters(), True, lr=123.0)
            opt.load_state_dict(torch.load(saved))
            keys = {"lars": {"momentum_buffer"}, "lamb": {"step", "exp_avg", "exp_avg_sq"}}[name]
            assert set(opt.state_dict()["state"][0]) == keys
        x, y = _batch(step, 6)
        for model, o in ((straight, opt_straight), (resumed, opt)):
            o.zero_grad()
            _loss(model, x, y).backward()
            o.step()
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), "lr must be >= 0"),
    (dict(lr=1.0, momentum=1.0), r"momentum must be \[0.0, 1.0\)"),
    (dict(lr=1.0, weight_decay=-0.1), "weight_decay must be >= 0"),
])
def test_bad_hyperparameters_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LARS(nn.Linear(2, 2).parameters(), **kwargs)
    with pytest.raises(ValueError, match=r"betas\[1\] must be"):
        LAMB(nn.Linear(2, 2).parameters(), betas=(0.9, 1.5))


# --------------------------------------------------------------------- distributed: layers split by ZeRO


@contextlib.contextmanager
def _counting_all_reduces():
    """Count torch.distributed.all_reduce calls (ZeRO's own backward may use it too: wrap the step alone)."""
    calls: list[int] = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(dist, "all_reduce", counting):
        yield calls


def _layers_by_ranks(zero: ZeRO, world_size: int) -> dict[str, int]:
    """How many ranks hold elements of each layer (pure layout arithmetic)."""
    out = {}
    for unit in zero.units:
        bounds = shard_bounds(unit.numel, world_size)
        for ref, (a, b) in zip(unit.refs, unit.offsets(), strict=True):
            out[ref.name] = sum(min(b, hi) > max(a, lo) for lo, hi in bounds)
    return out


def _broken(variant: str) -> contextlib.AbstractContextManager:
    """The optimizer with the per-layer property broken on purpose."""
    if variant == "per_shard":  # every shard one layer: what torch's own optimizers would see
        whole = lambda p: layerwise.LayerLayout(("",), (p.dim(),), (p.numel(),), p.device)  # noqa: E731
        return mock.patch.object(layerwise, "layer_layout", whole)
    if variant == "unsummed":  # per layer, but each rank only sees its piece
        return mock.patch.object(layerwise, "_sum_over_ranks", lambda squares, layouts: None)
    return contextlib.nullcontext()


def _train(rank: int, world_size: int, stage: int, variant: str, combos=COMBOS) -> dict:
    """Each (optimizer, exclude_1d): ZeRO against a plain replica on the global batch, after every step."""
    worst, calls = {}, {}
    for name, exclude_1d in combos:
        torch.manual_seed(0)
        model = Net()
        reference = copy.deepcopy(model)
        zero = ZeRO(model, stage=stage, **ZERO_KW[stage])
        with _broken(variant):
            opt_ref = _optimizer(name, reference.parameters(), exclude_1d)
            opt_zero = _optimizer(name, zero.parameters(), exclude_1d)
            diff, counts = 0.0, []
            for step in range(STEPS):
                x, y = _batch(step, MICRO * world_size)
                opt_ref.zero_grad()
                _loss(reference, x, y).backward()
                opt_ref.step()
                opt_zero.zero_grad()
                lo = rank * MICRO
                _loss(zero, x[lo:lo + MICRO], y[lo:lo + MICRO]).backward()
                with _counting_all_reduces() as step_calls:
                    opt_zero.step()
                counts.append(len(step_calls))
                got = zero.gathered_state()
                diff = max([diff] + [_relative(got[n], p.detach()) for n, p in reference.named_parameters()])
        worst[name, exclude_1d], calls[name, exclude_1d] = diff, counts
    return {"worst": worst, "calls": calls, "ranks": _layers_by_ranks(zero, world_size)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_the_unsharded_optimizer_after_every_step(stage: int, world_size: int) -> None:
    results = run_on_ranks(_train, world_size, stage, "layer", timeout=50)
    ranks = results[0]["ranks"]
    if world_size > 1:
        assert max(ranks.values()) > 1, ranks  # some layer really is split across ranks
        assert min(ranks.values()) < world_size, ranks  # and some rank holds none of some layer
    for result in results:
        assert max(result["worst"].values()) <= TOLERANCE, result["worst"]
        for counts in result["calls"].values():
            assert counts == [1] * STEPS, counts  # one all-reduce per step (one process group)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", ["per_shard", "unsummed"])
@pytest.mark.parametrize("stage, world_size", [(2, 3), (3, 2)])
def test_trust_ratio_per_shard_or_unsummed_would_fail_parity(stage: int, world_size: int, variant: str) -> None:
    results = run_on_ranks(_train, world_size, stage, variant, [("lars", False), ("lamb", True)], timeout=50)
    worst = results[0]["worst"]
    assert min(worst.values()) > 100 * TOLERANCE, worst


def _norms_against_oracle(rank: int, world_size: int, stage: int) -> dict:
    """layer_norms (one all-reduce per group) against naive_layer_norms (gather whole) on random shards."""
    torch.manual_seed(0)
    world = ZeRO(Net(), stage=stage, **ZERO_KW[stage])
    other = ZeRO(Net(), stage=stage, process_group=dist.new_group(list(range(world_size))), **ZERO_KW[stage])
    params = list(world.parameters()) + list(other.parameters())
    g = torch.Generator().manual_seed(rank)
    items = [(p, (p.detach(), torch.randn(p.shape, generator=g))) for p in params]
    with _counting_all_reduces() as calls:
        fast = layerwise.layer_norms([(layerwise.layer_layout(p), ts) for p, ts in items])
    worst = max(_relative(f, layerwise.naive_layer_norms(p, ts)) for f, (p, ts) in zip(fast, items, strict=True))
    empty = sum(p.numel() == 0 for p in params)
    # A step without gradients (here on every rank) still runs its collective and updates nothing.
    before = [p.detach().clone() for p in params]
    with _counting_all_reduces() as idle_calls:
        LAMB(params).step()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    return {"worst": worst, "calls": len(calls), "empty_shards": empty, "idle": (len(idle_calls), unchanged)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage, world_size", [(1, 2), (3, 3)])
def test_layer_norms_match_the_gather_everything_oracle(stage: int, world_size: int) -> None:
    results = run_on_ranks(_norms_against_oracle, world_size, stage, timeout=50)
    for result in results:
        assert result["worst"] <= 1e-6, result
        assert result["calls"] == 2, result  # one per process group
        assert result["idle"] == (2, True), result
    if stage == 3:
        assert sum(r["empty_shards"] for r in results) > 0  # the gain's unit: empty on ranks 1 and 2
