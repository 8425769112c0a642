"""The naive baseline: one blocking all-reduce per parameter, after backward.

The textbook algorithm with none of the engineering: wait for the whole backward, then
average each gradient with its own all-reduce. Nothing overlaps with computation and
every parameter pays the collective's latency. It is kept beside the bucketed engine as
its test oracle (same arithmetic, no cleverness to get wrong) and as the floor in
benchmarks (what bucketing and overlap buy).

Semantics match :class:`~dptrain.ddp.module.DistributedDataParallel` for the cases the
oracle is used for: rank 0's state is broadcast at construction, buffers before each
forward, a parameter that no rank used keeps ``.grad`` untouched, and ``no_sync()``
skips communication.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.ddp.autograd import (
    grad_accumulator,
    on_backward_reaching,
    queue_on_current_backward,
    will_accumulate,
)
from dptrain.ddp.replicas import broadcast_coalesced
from dptrain.ddp.sync_switch import GradSyncSwitch

__all__ = ["NaiveDataParallel"]


class NaiveDataParallel(GradSyncSwitch, nn.Module):
    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 broadcast_buffers: bool = True):
        super().__init__()
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.params = [p for p in module.parameters() if p.requires_grad]
        broadcast_coalesced(list(module.parameters()) + list(module.buffers()), 0, self.process_group)
        self._used = [False] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(_mark_used(weakref.ref(self), i))
        self._queued = False
        self._accumulators = [grad_accumulator(p) for p in self.params]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.require_backward_grad_sync:
            broadcast_coalesced(list(self.module.buffers()), 0, self.process_group)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            on_backward_reaching(output, self._queue_sync)
        return output

    def _queue_sync(self) -> None:
        if not self._queued and will_accumulate(self._accumulators):
            self._queued = True
            queue_on_current_backward(self.sync_gradients)

    def sync_gradients(self) -> None:
        """Average every parameter's gradient across ranks, one all-reduce each."""
        self._queued = False
        world = dist.get_world_size(self.process_group)
        used = torch.tensor(self._used, dtype=torch.int32, device=self.params[0].device)
        dist.all_reduce(used, group=self.process_group)
        for p, globally_used in zip(self.params, used.tolist(), strict=True):
            if not globally_used:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=self.process_group)
            p.grad = grad.div_(world)
        self._used = [False] * len(self.params)


def _mark_used(naive_ref: weakref.ref[NaiveDataParallel], index: int):
    def hook(_param: torch.Tensor) -> None:
        naive = naive_ref()
        if naive is not None:
            naive._used[index] = True
    return hook
