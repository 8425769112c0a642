"""Bytes of model state per rank: parameters, gradients, optimizer state (exact, from the layout).

For a model on the meta device and a :class:`~dptrain.planner.layout.Setup`, the bytes
each rank keeps between steps, as the engines allocate them (Ψ parameters, N ranks;
fp32 with Adam these are the ZeRO paper's 16Ψ, (8 + 8/N)Ψ, (4 + 12/N)Ψ and 16Ψ/N):

========  =========================================  ======================================
strategy  parameters                                 gradients
========  =========================================  ======================================
ddp       every parameter                            every gradient, plus the bucket
                                                     buffers unless gradients are views
                                                     of them (``gradient_as_bucket_view``)
zero1     each unit's full buffer in the compute     the full gradient buffer in the reduce
          dtype, plus the master shard when that     dtype, plus the master-dtype shard
          differs (bf16)                             when that differs
zero2     as zero1                                   the shard, in the master dtype
zero3     the master shard                           the shard, in the master dtype
========  =========================================  ======================================

Optimizer state is not derived from a formula: the optimizer itself takes one step on
meta-device tensors shaped like what it will see (every parameter for DDP, each unit's
shard for ZeRO) and the state it creates is counted. So any ``torch.optim`` optimizer
(and dptrain's LARS/LAMB) is planned exactly, Adam's one-element ``step`` tensors
included. Frozen parameters count as parameters, in the module's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dptrain.planner.layout import Setup, Unit, units

__all__ = ["States", "model_states", "optimizer_state_bytes", "adam"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The default optimizer to plan for: AdamW (two moments and a ``step`` per tensor)."""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass(frozen=True)
class States:
    """One rank's bytes held between steps, by category."""

    parameters: int
    gradients: int
    optimizer: int
    buffers: int = 0

    @property
    def total(self) -> int:
        """Model states: parameters, gradients and optimizer state (buffers apart)."""
        return self.parameters + self.gradients + self.optimizer


def optimizer_state_bytes(shapes: list[tuple[tuple[int, ...], torch.dtype]], optimizer: OptimizerFactory) -> int:
    """Bytes of state ``optimizer`` creates in one step over tensors of ``shapes`` (counted on the meta device).

    torch's optimizers keep state per parameter, determined by its shape and dtype, so
    one tensor of each distinct (shape, dtype) takes the step and its state counts once
    per tensor of that kind: a 70B model's 960 tensors, or ZeRO's thousands of equal
    shards, are a handful of distinct shapes.
    """
    counts: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
    for shape, dtype in shapes:
        counts[(tuple(shape), dtype)] = counts.get((tuple(shape), dtype), 0) + 1
    params = []
    for shape, dtype in counts:
        p = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        p.grad = torch.empty(shape, dtype=dtype, device="meta")
        params.append(p)
    if not params:
        return 0
    opt = optimizer(params)
    opt.step()
    total = 0
    for p, count in zip(params, counts.values(), strict=True):
        for value in opt.state.get(p, {}).values():
            if torch.is_tensor(value):
                total += count * value.untyped_storage().nbytes()
    return total


def model_states(model: nn.Module, setup: Setup, rank: int = 0, optimizer: OptimizerFactory = adam,
                 shapes: list[Unit] | None = None) -> States:
    """Rank ``rank``'s model-state bytes for ``model`` under ``setup`` (rank 0 holds the largest shards).

    ``shapes``: ``units(model, setup)`` when the caller has them (they do not depend on the world size).
    """
    if not 0 <= rank < setup.world_size:
        raise ValueError(f"rank {rank} is not in a world of {setup.world_size}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = sum(_nbytes(p) for p in model.parameters() if not p.requires_grad)
    buffers = sum(_nbytes(b) for b in model.buffers())
    if setup.stage == 0:
        grads = sum(_nbytes(p) for p in trainable)
        return States(parameters=frozen + grads, gradients=grads * (1 if setup.gradient_as_bucket_view else 2),
                      optimizer=optimizer_state_bytes([(tuple(p.shape), p.dtype) for p in trainable], optimizer),
                      buffers=buffers)
    params, grads, shards = frozen, 0, []
    for unit in shapes if shapes is not None else units(model, setup):
        n, s = unit.numel, unit.shard(setup.shards, rank % setup.shards)
        m = unit.dtype.itemsize
        c = setup.compute_dtype.itemsize if setup.compute_dtype is not None else m
        r = setup.reduce_dtype.itemsize if setup.compute_dtype is not None else c
        if setup.stage < 3:
            params += n * c + (s * m if c != m else 0)
        else:
            params += s * m
        if setup.stage == 1:
            grads += n * r + (s * m if r != m else 0)
        else:
            grads += s * m
        shards.append(((s,), unit.dtype))
    return States(parameters=params, gradients=grads, optimizer=optimizer_state_bytes(shards, optimizer),
                  buffers=buffers)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
