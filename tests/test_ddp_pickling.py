"""A wrapped model saved whole or deep-copied reloads and trains as torch's DDP does (issue 41)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _models import BatchNormNet, global_batch, loss_fn
from dptrain import DistributedDataParallel, ZeRO
from dptrain.comm import Traffic
from dptrain.testing import run_on_ranks


def _round_trip(model: nn.Module, how: str) -> nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(model)
    f = io.BytesIO()
    torch.save(model, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world_size: int, step: int) -> list[torch.Tensor]:
    x, y = global_batch("batchnorm", step, 4 * world_size)
    x, y = x[rank::world_size], y[rank::world_size]
    opt.zero_grad()
    loss_fn("batchnorm", model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads


def _copy_then_train(rank: int, world_size: int, how: str) -> list[float]:
    """Train ours and torch's one step, copy both, train the copies and the originals; the worst gradient gaps."""
    torch.manual_seed(0)
    base = BatchNormNet()
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0002)  # several buckets
    theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=0.0002)
    models = {"ours": ours, "theirs": theirs}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    for k in models:
        _step(models[k], opts[k], rank, world_size, 0)
    copies = {k: _round_trip(m, how) for k, m in models.items()}
    assert type(copies["ours"]) is DistributedDataParallel and copies["ours"].bucket_assignment == ours.bucket_assignment
    assert all(c is not o for c, o in zip(copies["ours"].parameters(), ours.parameters(), strict=True))
    copy_opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in copies.items()}
    gaps = []
    for step in (1, 2):  # the copy's first step is its reducer's discovery pass, the second its bucketed one
        for pair, pair_opts in ((copies, copy_opts), (models, opts)):
            g_ours = _step(pair["ours"], pair_opts["ours"], rank, world_size, step)
            g_theirs = _step(pair["theirs"], pair_opts["theirs"], rank, world_size, step)
            gaps.append(max((a - b).abs().max().item() for a, b in zip(g_ours, g_theirs, strict=True)))
    # the gradients were averaged across ranks: every rank holds the same
    mine = torch.cat([p.grad.flatten() for p in copies["ours"].parameters()])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    gaps.append(max((t - mine).abs().max().item() for t in everyone))
    return gaps


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_trains_with_torch_ddps_gradients(how: str) -> None:
    for gaps in run_on_ranks(_copy_then_train, 2, how):
        assert max(gaps) < 1e-6, gaps


def _refusal(rank: int, world_size: int, case: str) -> str:
    if case == "group":
        model = DistributedDataParallel(nn.Linear(3, 3), process_group=dist.new_group([0, 1]))
    elif case == "traffic":
        model = DistributedDataParallel(nn.Linear(3, 3), traffic=Traffic())
    elif case == "hook":
        model = DistributedDataParallel(nn.Linear(3, 3))
        model.register_comm_hook(None, allreduce_hook)
    else:
        model = ZeRO(nn.Linear(3, 3), stage=case)
    for attempt in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
        try:
            attempt(model)
        except (RuntimeError, TypeError) as e:
            message = f"{type(e).__name__}: {e}"
        else:
            return "not refused"
    return message


@pytest.mark.parametrize("case, expected", [
    ("group", "RuntimeError: cannot pickle or deepcopy dptrain's DistributedDataParallel: it was built on a "
              "process group other than the default one"),
    ("traffic", "RuntimeError: cannot pickle or deepcopy dptrain's DistributedDataParallel: its traffic= counter"),
    ("hook", "RuntimeError: cannot pickle or deepcopy dptrain's DistributedDataParallel: it has a communication "
             "hook (allreduce_hook) registered"),
    (3, "TypeError: cannot pickle or deepcopy dptrain's ZeRO"),
    (1, "TypeError: cannot pickle or deepcopy dptrain's ZeRO"),
])
def test_what_a_copy_cannot_carry_is_refused_by_name(case, expected: str) -> None:
    for message in run_on_ranks(_refusal, 2, case):
        assert message.startswith(expected), message
        assert "model.module" in message or "state_dict" in message


def _pickled(rank: int, world_size: int) -> bytes:
    return pickle.dumps(DistributedDataParallel(nn.Linear(3, 3)))


def test_loading_without_a_process_group_says_to_initialise_one() -> None:
    blob = run_on_ranks(_pickled, 2)[0]
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised: call init_process_group before"):
        pickle.loads(blob)
