"""The replicas' average: every rank's parameters replaced by their mean over the group, in place.

The fast version packs every parameter into one flat buffer and runs one all-reduce
(dptrain's collective, so its bytes are counted as every collective's are); the naive
version all-reduces each tensor on its own, one latency per parameter. The naive one is
the oracle in tests: both compute the same sums in the same order per element, so they
agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dptrain import comm

__all__ = ["average_parameters", "average_parameters_naive"]


@torch.no_grad()
def average_parameters(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                       algorithm: str = "native") -> int:
    """Replace each of ``params`` by its mean over ``group`` with one flat all-reduce; return the bytes reduced."""
    if not params:
        return 0
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    comm.all_reduce(flat, algorithm=algorithm, group=group)
    flat.div_(dist.get_world_size(group))
    torch._foreach_copy_(list(params), [piece.view_as(p) for piece, p in
                                        zip(flat.split([p.numel() for p in params]), params, strict=True)])
    return flat.numel() * flat.element_size()


@torch.no_grad()
def average_parameters_naive(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> int:
    """The oracle: one ``torch.distributed.all_reduce`` per parameter, then a division; return the bytes."""
    for p in params:
        dist.all_reduce(p, group=group)
        p.div_(dist.get_world_size(group))
    return sum(p.numel() * p.element_size() for p in params)
