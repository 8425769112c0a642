"""What the engine communicates, and when: overlap with backward, calls and bytes per step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from _models import IN, OUT, build, global_batch, loss_fn
from dptrain import DistributedDataParallel, allreduce_hook
from dptrain.testing import run_on_ranks

MICRO = 4


def _deep_mlp() -> nn.Module:
    layers = []
    for _ in range(6):
        layers += [nn.Linear(IN, IN), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(IN, OUT))


def _record_overlap(rank: int, world_size: int) -> list[list[tuple]]:
    torch.manual_seed(0)
    model = _deep_mlp()
    events: list[tuple] = []

    def recording_hook(state, bucket):
        events.append(("launch", bucket.index()))
        return allreduce_hook(state, bucket)

    # A gradient hook on the *first* layer fires when backward reaches it, i.e. near
    # the very end of backward; launches before it happened while backward ran.
    model[0].weight.register_hook(lambda grad: events.append(("first_layer_grad",)))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0002)
    ddp.register_comm_hook(dist.group.WORLD, recording_hook)
    per_step = []
    for step in range(3):
        events.clear()
        x, y = global_batch("mlp", step, MICRO)
        loss_fn("mlp", ddp(x), y).backward()
        per_step.append(list(events))
    return per_step


def test_buckets_are_reduced_while_backward_is_still_running() -> None:
    for rank, per_step in enumerate(run_on_ranks(_record_overlap, 2)):
        first, *later = per_step
        # Step 1 is the discovery pass: every bucket is launched after backward.
        assert first[0] == ("first_layer_grad",), first
        for events in later:
            launches = [e[1] for e in events if e[0] == "launch"]
            assert len(launches) >= 4, events
            assert launches == sorted(launches), f"rank {rank}: buckets launched out of order: {events}"
            end_of_backward = events.index(("first_layer_grad",))
            launched_before = [e for e in events[:end_of_backward] if e[0] == "launch"]
            assert len(launched_before) >= len(launches) - 1, (
                f"rank {rank}: only {len(launched_before)} of {len(launches)} buckets were launched "
                f"before backward reached the first layer: {events}")


class _CountCollectives(TorchDispatchMode):
    """Bytes of every all-reduce and broadcast, by the ops the process group dispatches (whatever route called
    it: ``dist.all_reduce`` or the engine's prepared ``ProcessGroup.allreduce``)."""

    OPS = {"c10d.allreduce_.default": "all_reduce", "c10d.broadcast_.default": "broadcast"}

    def __init__(self, counted: dict[str, list[int]]):
        super().__init__()
        self.counted = counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.OPS.get(str(func))
        if name is not None:
            self.counted[name] += [t.numel() * t.element_size() for t in args[0]]
        return func(*args, **(kwargs or {}))


def _count_communication(rank: int, world_size: int, model_name: str, ddp_kwargs: dict) -> dict:
    counted = {"all_reduce": [], "broadcast": []}
    torch.manual_seed(0)
    model = build(model_name)
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    steps = []
    with _CountCollectives(counted):
        for step in range(3):
            for calls in counted.values():
                calls.clear()
            x, y = global_batch(model_name, step, MICRO)
            loss_fn(model_name, ddp(x), y).backward()
            stats = ddp.last_step_comm
            steps.append({"counted": {k: list(v) for k, v in counted.items()},
                          "stats": (stats.calls, stats.bytes), "buckets": len(ddp.reducer.buckets)})
    return {"steps": steps,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "n_params": len(list(model.parameters()))}


def test_each_step_sends_one_call_per_bucket_and_exactly_the_gradient_bytes() -> None:
    for result in run_on_ranks(_count_communication, 2, "mlp", {"bucket_cap_mb": 0.0004}):
        discovery, *steps = result["steps"]
        # The first step also agrees once on whether gradients arrive in pieces (4 bytes).
        assert discovery["counted"]["all_reduce"][-1] == 4
        assert discovery["counted"]["all_reduce"][:-1] == steps[0]["counted"]["all_reduce"]
        for step in steps:
            sizes = step["counted"]["all_reduce"]
            assert len(sizes) == step["buckets"] > 1
            assert sum(sizes) == result["param_bytes"]
            assert step["counted"]["broadcast"] == []  # the MLP has no buffers
            assert step["stats"] == (len(sizes), sum(sizes))


def test_buffers_and_unused_map_are_counted_too() -> None:
    bn = run_on_ranks(_count_communication, 2, "bn", {})
    for result in bn:
        for step in result["steps"][1:]:
            # Buffers go out once per step, one broadcast per dtype (float stats, int64 count).
            assert len(step["counted"]["broadcast"]) == 2
            assert sum(step["counted"]["broadcast"]) == result["buffer_bytes"]
            assert sum(step["counted"]["all_reduce"]) == result["param_bytes"]
            total = sum(step["counted"]["all_reduce"]) + sum(step["counted"]["broadcast"])
            assert step["stats"] == (len(step["counted"]["all_reduce"]) + 2, total)
    unused = run_on_ranks(_count_communication, 2, "branchy", {"find_unused_parameters": True})
    for result in unused:
        for step in result["steps"][1:]:
            # One extra small all-reduce: which parameters any rank used, and one flag per
            # bucket saying whether some rank must reduce it again (a changed graph).
            *grads, used_map = step["counted"]["all_reduce"]
            assert len(grads) == step["buckets"]
            assert sum(grads) == result["param_bytes"]
            assert used_map == (result["n_params"] + step["buckets"]) * 4


def _frozen_layer_is_synced(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(rank)  # every rank initialises differently
    model = nn.Sequential(nn.Linear(IN, IN), nn.Tanh(), nn.Linear(IN, OUT))
    model[0].requires_grad_(False)  # a frozen layer: no gradient, but it must still match
    DistributedDataParallel(model)
    return [p.detach().sum().item() for p in model.parameters()]


def test_construction_broadcasts_frozen_parameters_too() -> None:
    results = run_on_ranks(_frozen_layer_is_synced, 3)
    assert results[1] == results[0] and results[2] == results[0]
