"""Stage 3: weights that autograd saved for backward, kept as references to their unit, not as tensors.

Forward runs under ``torch.autograd.graph.saved_tensors_hooks``: a saved tensor that is
a view of a resharding unit's full buffer (one of ``live``, by the buffer's ``id``) is
packed as (unit, offset, size, stride) instead of being kept, so releasing the unit
after its forward really frees the weights. Unpacking it in backward all-gathers the
unit again (or waits for its prefetch). The same idea as activation offloading, applied
to weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dptrain.zero.unit import FlatUnit

__all__ = ["pack_weight", "unpack_weight"]


@dataclass
class _Packed:
    unit: FlatUnit
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def pack_weight(live: dict[int, FlatUnit], t: torch.Tensor) -> Any:
    """``t`` itself, or a reference to it if it is a view of a live unit's full buffer."""
    base = t._base
    unit = live.get(id(base)) if base is not None else None
    if unit is None or unit.full is not base:
        return t
    return _Packed(unit, t.storage_offset() - base.storage_offset(), tuple(t.shape), tuple(t.stride()))


def unpack_weight(packed: Any, regathered: Callable[[FlatUnit], None]) -> torch.Tensor:
    """The saved tensor; a packed view gathers its unit if needed, calling ``regathered(unit)`` when it had to."""
    if not isinstance(packed, _Packed):
        return packed
    unit = packed.unit
    first = unit.full is None or unit._gathering is not None
    full = unit.wait_gathered()
    if first:
        regathered(unit)
    return full.as_strided(packed.size, packed.stride, packed.offset)
