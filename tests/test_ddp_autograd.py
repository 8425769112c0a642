"""The engine under less common uses of autograd, each checked against a reference.

Gradient penalties (``autograd.grad`` through the outputs), in-place operations and
unusual containers on the outputs, a backward that raises, a synced and a ``no_sync``
forward feeding one backward, and graphs that change differently on different ranks.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from _models import IN, build, global_batch, loss_fn, max_relative_diff
from dptrain import DistributedDataParallel, NaiveDataParallel
from dptrain.testing import run_on_ranks

MICRO = 4
STEPS = 4


def _penalised_loss(model, x, y):
    """MSE plus a gradient penalty on d(output)/d(input), as in WGAN-GP or R1."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return loss_fn("mlp", out, y) + 0.1 * dx.pow(2).sum(dim=1).mean()


def _gradient_penalty(rank: int, world_size: int, ddp_kwargs: dict) -> list[float]:
    torch.manual_seed(0)
    reference = build("mlp")
    model = DistributedDataParallel(copy.deepcopy(reference), **ddp_kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    diffs = []
    for step in range(STEPS):
        x, y = global_batch("mlp", step, MICRO * world_size)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        for m, opt, (xs, ys) in ((model, opts[0], (x[rows], y[rows])), (reference, opts[1], (x, y))):
            opt.zero_grad()
            _penalised_loss(m, xs, ys).backward()
            opt.step()
        diffs.append(max_relative_diff(model.module, reference))
    return diffs


@pytest.mark.parametrize("ddp_kwargs", [{}, {"find_unused_parameters": True}])
def test_gradient_penalty_through_the_outputs(ddp_kwargs: dict) -> None:
    # autograd.grad(out, x) passes through the outputs' nodes but writes no .grad: the
    # engine must not start (and finish) a reduction there.
    for rank, diffs in enumerate(run_on_ranks(_gradient_penalty, 2, ddp_kwargs)):
        assert max(diffs) <= 1e-5, f"rank {rank}: {diffs}"


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    tag: str = dataclasses.field(default="x", init=False)


def _unusual_outputs(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build("mlp")

        def forward(self, x, kind):
            out = self.net(x)
            if kind == "defaultdict":
                return collections.defaultdict(list, logits=out)
            if kind == "dataclass":
                return _Out(out)
            return out

    model = DistributedDataParallel(Wrapped())
    reference = NaiveDataParallel(copy.deepcopy(model.module))
    results = {}
    for kind in ("defaultdict", "dataclass", "inplace"):
        x, y = global_batch("mlp", 0, MICRO)
        for m in (model, reference):
            m.zero_grad()
            out = m(x, kind)
            if kind == "inplace":
                out.mul_(2.0)  # in-place on the output, as some loss code does
                logits = out
            else:
                logits = out["logits"] if kind == "defaultdict" else out.logits
            results.setdefault(kind, []).append(type(out).__name__)
            loss_fn("mlp", logits, y * (rank + 1)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results[kind].append(max((g - r.grad).abs().max().item() for g, r in zip(grads, reference.parameters(), strict=True)))
    return results


def test_outputs_are_returned_as_they_are_and_in_place_ops_work() -> None:
    for result in run_on_ranks(_unusual_outputs, 2):
        assert result["defaultdict"][:2] == ["defaultdict", "defaultdict"]
        assert result["dataclass"][:2] == ["_Out", "_Out"]
        for kind, (*_, grad_gap) in result.items():
            assert grad_gap <= 1e-6, f"{kind}: gradients differ from the naive oracle by {grad_gap}"


class _FailingOnce(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailingOnce.armed:
            raise RuntimeError("injected failure in backward")
        return grad


class _FailsInTheMiddle(nn.Module):
    """Backward through ``_FailingOnce`` happens after the later layers' buckets launched."""

    def __init__(self):
        super().__init__()
        self.early = nn.Sequential(nn.Linear(IN, IN), nn.Tanh())
        self.late = nn.Sequential(nn.Linear(IN, IN), nn.Tanh(), nn.Linear(IN, 3))

    def forward(self, x):
        return self.late(_FailingOnce.apply(self.early(x)))


def _recover_after_failed_backward(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = DistributedDataParallel(_FailsInTheMiddle(), bucket_cap_mb=0.0002)
    reference = NaiveDataParallel(copy.deepcopy(model.module))
    caught, warned, launched_before_failure = None, [], None
    for step in range(4):
        x, y = global_batch("mlp", step, MICRO)
        for m in (model, reference):
            m.zero_grad()
            _FailingOnce.armed = step == 2 and m is model
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                try:
                    loss_fn("mlp", m(x), y * (rank + 1)).backward()
                except RuntimeError as e:
                    caught = str(e)
                    launched_before_failure = len(m.reducer._handles)
            warned += [str(x.message) for x in w]
    _FailingOnce.armed = False
    return {"caught": caught, "warned": warned, "launched": launched_before_failure,
            "gap": max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True))}


def test_a_backward_that_raises_leaves_the_next_step_correct() -> None:
    # Step 2's backward raises on every rank after some buckets were launched; step 3
    # must not mix those reductions into its own.
    for result in run_on_ranks(_recover_after_failed_backward, 2):
        assert result["caught"] and "injected failure" in result["caught"]
        assert result["launched"] >= 1, "the failure should come after some buckets were launched"
        assert any("did not complete" in w for w in result["warned"])
        assert result["gap"] <= 1e-6


def _synced_then_no_sync_forward(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 1, bias=False))
    x = torch.ones(1, 3) * (rank + 1)
    first = model(x)
    with model.no_sync():
        second = model(x)
    (first + second).sum().backward()
    return model.module.weight.grad.flatten().tolist()


def test_a_pending_synced_forward_is_reduced_even_if_a_no_sync_forward_follows() -> None:
    grads = run_on_ranks(_synced_then_no_sync_forward, 2)
    assert grads[0] == grads[1] == [3.0, 3.0, 3.0]  # mean over ranks of 2 x (1 and 2)


def _rank_dependent_pieces(rank: int, world_size: int, name: str, kwargs: dict) -> list[float]:
    torch.manual_seed(0)
    reference = build(name)
    model = DistributedDataParallel(copy.deepcopy(reference), bucket_cap_mb=0.0004, **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    arg = "groups" if name == "regrouped" else "segments"
    schedule = {0: [3, 2, 3, 3, 2, 3], 1: [3, 3, 3, 2, 2, 3]}  # differs by rank and by step
    diffs = []
    for step in range(6):
        x, y = global_batch("mlp", step, MICRO * world_size)
        opts[0].zero_grad()
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss_fn("mlp", model(x[rows], **{arg: schedule[rank][step]}), y[rows]).backward()
        opts[0].step()
        opts[1].zero_grad()
        for r in range(world_size):
            rows = slice(r * MICRO, (r + 1) * MICRO)
            (loss_fn("mlp", reference(x[rows], **{arg: schedule[r][step]}), y[rows]) / world_size).backward()
        opts[1].step()
        diffs.append(max_relative_diff(model.module, reference))
    return diffs


@pytest.mark.parametrize("name,kwargs", [
    ("ckpt_reentrant", {"find_unused_parameters": True}),  # unused blocks and changing pieces
    ("regrouped", {}),  # every parameter used; only the number of pieces changes, per rank
])
def test_graphs_that_change_differently_on_each_rank(name: str, kwargs: dict) -> None:
    # Late gradient pieces make a rank reduce a bucket again; the ranks agree on which
    # buckets, so their collectives stay in step and the result is exact.
    for rank, diffs in enumerate(run_on_ranks(_rank_dependent_pieces, 2, name, kwargs)):
        assert max(diffs) <= 1e-5, f"rank {rank}: {diffs}"


class _Swapped(nn.Module):
    """Blocks whose second-registered layer runs first: gradients arrive out of registration order."""

    def __init__(self, blocks: int = 4):
        super().__init__()
        self.firsts = nn.ModuleList(nn.Linear(IN, IN) for _ in range(blocks))
        self.seconds = nn.ModuleList(nn.Linear(IN, IN) for _ in range(blocks))

    def forward(self, x):
        for first, second in zip(self.firsts, self.seconds, strict=True):
            x = torch.tanh(first(torch.tanh(second(x))))
        return x


def _launches_with_swapped_arrivals(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = _Swapped()
    model = DistributedDataParallel(copy.deepcopy(reference), bucket_cap_mb=0.0004)  # a few parameters a bucket
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    launched, diffs = [], []
    for step in range(3):
        x = torch.randn(MICRO * world_size, IN, generator=torch.Generator().manual_seed(step))
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        for m, opt, xs in ((model, opts[0], x[rows]), (reference, opts[1], x)):
            opt.zero_grad()
            m(xs).pow(2).mean().backward()
            opt.step()
        launched.append(model.last_step_comm.launched_during_backward)
        diffs.append(max_relative_diff(model.module, reference))
    return {"launched": launched, "buckets": len(model.reducer.buckets), "diffs": diffs}


def test_buckets_launch_during_backward_when_gradients_arrive_out_of_registration_order() -> None:
    # Each bucket's check runs in the hook of the parameter whose gradient came last in the
    # previous step ([Note: arrival logs]): after the discovery step, every bucket is launched
    # during backward even though the registration order predicted another last arrival.
    for result in run_on_ranks(_launches_with_swapped_arrivals, 2):
        assert result["buckets"] >= 3
        assert result["launched"][0] == 0  # discovery: everything at the end
        assert result["launched"][1:] == [result["buckets"]] * 2, result
        assert max(result["diffs"]) <= 1e-5, result["diffs"]


def _loss_without_the_outputs(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    model(torch.ones(2, 3)).sum().backward()  # step 1, through the outputs: fine
    model(torch.ones(2, 3))
    model.module[1].weight.sum().backward()  # not through the outputs, and not the bucket's trigger
    try:
        model(torch.ones(2, 3))
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_synced_backward_that_never_reaches_the_outputs_is_an_error_at_the_next_forward() -> None:
    for message in run_on_ranks(_loss_without_the_outputs, 2):
        assert "were not averaged" in message and "1.weight" in message, message
