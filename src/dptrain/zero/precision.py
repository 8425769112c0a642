"""Mixed precision for ZeRO: low-precision compute, fp32 master shards, a chosen reduce dtype.

Mixed-precision training (Micikevicius et al., "Mixed Precision Training", ICLR 2018)
computes forward and backward in 16-bit while the optimizer updates an fp32 *master*
copy of the weights, so that updates smaller than a bf16 ulp are not lost. Under ZeRO
the master copy is the shard: each rank keeps its 1/N of the parameters in fp32 (the
optimizer's Parameter), casts it to ``param_dtype`` before the all-gather, and the
units' full buffers, the views the modules compute with and the gradients backward
produces are in ``param_dtype``. Gradients are cast to ``reduce_dtype`` for the
reduce-scatter (fp32 for exact averaging, bf16 for half the bytes on the wire) and to
the master dtype for the optimizer.

    ZeRO(model, stage=3, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32))

This is the policy of torch's FSDP2 ``MixedPrecisionPolicy`` and DeepSpeed's bf16 mode,
without autocast: the module itself runs in ``param_dtype``, so floating-point inputs
are cast to it (``cast_inputs``) and outputs optionally back (``output_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["MixedPrecision"]


@dataclass(frozen=True)
class MixedPrecision:
    """What ZeRO computes, communicates and returns in; the shards stay in the model's dtype."""

    param_dtype: torch.dtype | None = torch.bfloat16   # compute (and all-gather) dtype; None: the model's
    reduce_dtype: torch.dtype | None = None             # gradient reduce-scatter dtype; None: param_dtype
    output_dtype: torch.dtype | None = None             # cast floating outputs to this; None: leave them
    cast_inputs: bool = True                            # cast floating inputs to param_dtype

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating-point torch.dtype or None, got "
                                 f"{value!r}; e.g. torch.bfloat16 or torch.float32")


def cast_floats(tree: Any, dtype: torch.dtype | None) -> Any:
    """``tree`` (tensors in any nesting of lists, tuples, dicts) with floating-point tensors cast to ``dtype``."""
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, tree)
