"""torch's DDP surface on dptrain's (issue 41): exception types torch code catches, torch 2.13's arguments and methods.

Each case runs against both wrappers in one world-size-1 gloo group, so the table in
docs/ddp.md is checked against what torch really raises, not against a copy of it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dptrain import DistributedDataParallel, ReplicaMismatchError
from dptrain.ddp import NothingToTrainError, NotInitialisedError
from dptrain.testing import run_on_ranks


def _raised(fn) -> type[BaseException] | None:
    try:
        fn()
    except Exception as e:  # the test compares the types
        return type(e)
    return None


# situation -> how to provoke it with a wrapper class
_SITUATIONS = {
    "no parameters": lambda cls: cls(nn.Module()),
    "frozen model": lambda cls: cls(nn.Linear(2, 2).requires_grad_(False)),
    "lazy parameters": lambda cls: cls(nn.LazyLinear(3)),
    "several device_ids": lambda cls: cls(nn.Linear(2, 2), device_ids=[0, 1]),
    "parameters on several device types": lambda cls: cls(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))),
    "hook not callable": lambda cls: cls(nn.Linear(2, 2)).register_comm_hook(None, 3),
    "unknown keyword": lambda cls: cls(nn.Linear(2, 2), bukcet_cap_mb=1),
}


def _types_raised(rank: int, world_size: int) -> dict[str, tuple]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: (_raised(lambda f=f: f(TorchDDP)), _raised(lambda f=f: f(DistributedDataParallel)))
                for name, f in _SITUATIONS.items()}


def test_dptrain_errors_are_caught_by_the_type_torch_raises() -> None:
    for name, (theirs, ours) in run_on_ranks(_types_raised, 1)[0].items():
        assert theirs is not None and ours is not None, name
        assert issubclass(ours, theirs), f"{name}: torch raises {theirs.__name__}, dptrain {ours.__name__}"
    assert issubclass(NothingToTrainError, RuntimeError) and issubclass(NothingToTrainError, ValueError)
    assert issubclass(ReplicaMismatchError, RuntimeError) and issubclass(ReplicaMismatchError, ValueError)


def test_uninitialised_group_is_caught_as_torchs_value_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError):  # torch's type
        TorchDDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="call torch.distributed.init_process_group") as caught:
        DistributedDataParallel(nn.Linear(2, 2))
    assert isinstance(caught.value, (NotInitialisedError, RuntimeError))


def _lazy_message(rank: int, world_size: int) -> str:
    try:
        DistributedDataParallel(nn.LazyLinear(3))
    except RuntimeError as e:
        return str(e)
    return "not refused"


def test_lazy_parameters_are_named_with_the_fix() -> None:
    message = run_on_ranks(_lazy_message, 1)[0]
    assert "['weight', 'bias'] are uninitialised" in message and "run one forward" in message


# torch 2.13's constructor keywords that dptrain does not implement: refused by name, with what to do
_REFUSED = {
    "mixed_precision": object(), "device_mesh": object(), "delay_all_reduce_named_params": [],
    "param_to_hook_all_reduce": object(), "skip_all_reduce_unused_params": True, "bucket_cap_mb_list": [1],
    "batched_grad_copy": False,
}


def _surface(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, value in _REFUSED.items():
        try:
            DistributedDataParallel(nn.Linear(2, 2), **{name: value})
            out[name] = "accepted"
        except TypeError as e:
            out[name] = str(e)
    bn = nn.BatchNorm1d(2)
    out["batched_grad_copy=True"] = DistributedDataParallel(bn, batched_grad_copy=True).forward_sync_buffers
    quiet = DistributedDataParallel(nn.BatchNorm1d(2), forward_sync_buffers=False)
    out["forward_sync_buffers=False"] = (quiet.broadcast_buffers, quiet.will_sync_module_buffers())
    loud = DistributedDataParallel(nn.BatchNorm1d(2))
    out["will_sync_module_buffers"] = loud.will_sync_module_buffers()
    x = torch.arange(8.0).reshape(4, 2)
    ins, kws = loud.to_kwargs((x,), {"y": x}, 0)
    out["to_kwargs"] = torch.equal(ins[0][0], x) and torch.equal(kws[0]["y"], x) and len(ins) == len(kws) == 1
    torchs = TorchDDP(nn.Linear(2, 2))  # torch's gather and scatter are for CUDA: on CPU both refuse alike
    out["gather"] = [_raised(lambda m=m: m.gather([x[:2], x[2:]], "cpu")) for m in (torchs, loud)]
    return out


def test_torch_213_arguments_and_methods_are_implemented_or_refused_by_name() -> None:
    out = run_on_ranks(_surface, 1)[0]
    for name in _REFUSED:
        assert f"does not support torch's {name!r}" in out[name] or f"supports torch's {name!r} only as" in out[name]
    assert out["batched_grad_copy=True"] is True
    assert out["forward_sync_buffers=False"] == (False, False)
    assert out["will_sync_module_buffers"] is True
    assert out["to_kwargs"]
    assert out["gather"][0] is not None and out["gather"][0] is out["gather"][1]


def _buffers_after_construction(rank: int, world_size: int) -> dict[tuple[str, str], list[float]]:
    # a rank-local buffer (rank 0: 0.0, rank 1: 1.0), after each wrapper's construction with each option
    out = {}
    for label, cls in (("torch", TorchDDP), ("dptrain", DistributedDataParallel)):
        for kwargs in ({}, {"broadcast_buffers": False}, {"broadcast_buffers": False, "forward_sync_buffers": False}):
            module = nn.BatchNorm1d(2)
            module.running_mean.fill_(float(rank))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch 2.13 calls broadcast_buffers deprecated
                cls(module, **kwargs)
            out[(label, str(sorted(kwargs.items())))] = module.running_mean.tolist()
    return out


def test_broadcast_buffers_false_keeps_rank_local_buffers_at_construction_as_torch() -> None:
    rank1 = run_on_ranks(_buffers_after_construction, 2)[1]
    expected = {"[]": [0.0, 0.0], "[('broadcast_buffers', False)]": [1.0, 1.0],
                "[('broadcast_buffers', False), ('forward_sync_buffers', False)]": [0.0, 0.0]}
    for options, buffer in expected.items():
        assert rank1[("torch", options)] == buffer, options  # what torch 2.13 does
        assert rank1[("dptrain", options)] == buffer, options
