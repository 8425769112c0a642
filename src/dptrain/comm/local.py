"""The local half of a reduction: adding what arrived to what this rank holds.

fp16 and bf16 are summed in fp32 and rounded once per local reduction, so a rank that
adds k incoming buffers (a tree node with k children, the naive algorithm's n-way sum)
rounds once, not k times. Other dtypes add in their own type: integer sums are exact
(wrapping on overflow as the backend's do), fp32/fp64 round as any sum does.
"""

from __future__ import annotations

import torch

__all__ = ["LOW_PRECISION", "accumulator", "finish", "split", "views"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulator(x: torch.Tensor, wire) -> torch.Tensor:
    """A buffer to sum into, starting from ``x``: an fp32 copy for half types, else ``x`` itself."""
    if x.dtype not in LOW_PRECISION:
        return x
    acc = wire.scratch(x.numel(), torch.float32, x.device, slot=1)
    acc.copy_(x)
    return acc


def finish(acc: torch.Tensor, x: torch.Tensor) -> None:
    """Write a finished sum back into ``x`` (one rounding for half types)."""
    if acc is not x:
        x.copy_(acc)


def views(x: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The slices of flat ``x`` for ``ranges`` (contiguous views, written in place)."""
    return [x[a:b] for a, b in ranges]


def split(t: torch.Tensor, block: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive pieces of flat ``t`` sized like the ranges of ``block`` (a packed block)."""
    out, start = [], 0
    for a, b in block:
        out.append(t[start:start + b - a])
        start += b - a
    return out
