"""A deleted DistributedDataParallel frees everything it held at once, and the next one trains exactly.

[Note: nothing holds the reducer but its module] in ``ddp/reducer.py``: before it, the
arrival log kept the reducer's bound hook maker, a reference cycle that kept a deleted
instance's reducer, parameters, gradients and bucket buffers alive until the garbage
collector's next full collection; in ``dptrain bench ddp --held-out`` that never came, and
each deleted pair left about 250 MiB resident (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.testing import run_on_ranks

OPTIONS = {
    "default": {},
    "views": {"gradient_as_bucket_view": True},
    "find_unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Linear(8, 4))


def _deleted_instance_is_freed(rank: int, world_size: int, options: dict) -> dict:
    gc.collect()
    gc.disable()  # what is freed below is freed by reference counting alone
    try:
        model = DistributedDataParallel(_model(), bucket_cap_mb=0.0005, **options)
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
        param = next(model.module.parameters())
        refs = {"wrapper": weakref.ref(model), "reducer": weakref.ref(model.reducer),
                "bucket buffer": weakref.ref(model.reducer.buckets[0].buffer),
                "parameter": weakref.ref(param), "gradient": weakref.ref(param.grad)}
        del model, param
        return {name: ref() is None for name, ref in refs.items()}
    finally:
        gc.enable()


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_a_deleted_ddp_frees_its_reducer_parameters_and_buckets_without_the_garbage_collector(options):
    for freed in run_on_ranks(_deleted_instance_is_freed, 2, options):
        assert freed == dict.fromkeys(freed, True)


def _rewrapped_matches_torch(rank: int, world_size: int) -> float:
    """A pair at 1 MiB trained then deleted, then a pair at 25 MiB compared after every step (the held-out order)."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    first = DistributedDataParallel(_model(), bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        first(x).pow(2).mean().backward()
        opt.step()
    del first, opt
    ours, theirs = DistributedDataParallel(_model(1), bucket_cap_mb=25), nn.parallel.DistributedDataParallel(
        _model(1), bucket_cap_mb=25)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    worst = 0.0
    for _ in range(4):
        for model, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            worst = max(worst, (a - b).abs().max().item())
    return worst


def test_a_model_wrapped_after_a_deleted_one_matches_torch_ddp_after_every_step():
    for worst in run_on_ranks(_rewrapped_matches_torch, 2):
        assert worst <= 1e-6
