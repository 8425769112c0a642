"""The norm of a gradient sharded across ranks, and clipping by it.

Gradient clipping (Pascanu et al., "On the difficulty of training recurrent neural
networks", ICML 2013) scales the whole gradient when its norm exceeds a threshold. Under
ZeRO no rank holds the whole gradient: each rank sums its shards' squares (in fp32) and
one all-reduce over the shard group adds them up (for the inf-norm, the maximum), so
every rank gets the same norm, scales by the same factor and takes the same decision
about a non-finite one. Replicas under hybrid sharding hold the same shards, so the
shard group alone makes the whole gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["clip_sharded_grad_norm_"]


@torch.no_grad()
def clip_sharded_grad_norm_(shards: list[torch.Tensor], max_norm: float, norm_type: float,
                            group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """Scale the gradients of ``shards`` so the whole gradient's norm is at most ``max_norm``; the norm before.

    A non-finite norm is returned as it is and nothing is scaled (skip the step then).
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2.0 or inf for a sharded gradient norm, got {norm_type!r}")
    grads = [s.grad for s in shards if s.grad is not None and s.grad.numel()]
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        g = g.detach().float()
        local = torch.maximum(local, g.abs().max()) if norm_type == math.inf else local + g.pow(2).sum()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM, group=group)
    norm = local if norm_type == math.inf else local.sqrt()
    if math.isfinite(max_norm) and torch.isfinite(norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm
