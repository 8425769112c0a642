"""A model wrapped for data parallelism through the strategy registry, with the user API's precision.

``Engine`` and ``prepare()`` name a strategy and a precision; the registry entry wraps the
model (:class:`~dptrain.strategies.registry.Strategy`), and its facts decide how precision
is applied, never its name:

- a strategy that replaces the parameters with shards (``shards_parameters``: ZeRO) casts
  the module itself from fp32 master shards, so bf16 becomes its ``MixedPrecision`` and
  there is no autocast; fp16 is refused, since its loss scaler would have to see every
  rank's shard;
- the others run the forward under ``torch.autocast`` (:func:`autocast_dtype`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.strategies.registry import Strategy
from dptrain.zero import MixedPrecision

__all__ = ["wrap_model", "autocast_dtype", "options_for"]

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def wrap_model(entry: Strategy, model: nn.Module, *, precision: str, process_group: dist.ProcessGroup | None,
               options: dict[str, Any] | None, output_dtype: torch.dtype | None = None) -> nn.Module:
    """``entry.wrap(model, ...)`` with ``options``; ``output_dtype``: what a self-casting wrapper returns in."""
    options = dict(options or {})
    if entry.shards_parameters:
        options = _sharded_precision(entry, precision, options, output_dtype)
    return entry.wrap(model, process_group=process_group, **options)


def autocast_dtype(entry: Strategy, precision: str) -> torch.dtype | None:
    """The dtype to autocast the forward to, None where the wrapper casts the module itself or for fp32."""
    if precision not in _AUTOCAST:
        raise ValueError(f"unknown precision {precision!r}; use fp32, bf16 or fp16")
    return None if entry.shards_parameters else _AUTOCAST[precision]


def options_for(entry: Strategy, **by_argument: dict | None) -> dict[str, Any] | None:
    """Of the user API's ``ddp_kwargs=``, ``zero_kwargs=``, ``gossip_kwargs=``: the one ``entry``'s wrapper takes."""
    return by_argument.get(entry.options_argument)


def _sharded_precision(entry: Strategy, precision: str, options: dict[str, Any],
                       output_dtype: torch.dtype | None) -> dict[str, Any]:
    reduce_dtype = options.pop("reduce_dtype", torch.float32)  # the runner's [zero] reduce_dtype, for bf16
    if precision == "fp16":
        raise ValueError(f"precision fp16 is not supported with strategy {entry.name} (it needs a loss scaler over "
                         "sharded gradients); use bf16, which needs none")
    if precision == "bf16":
        options["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                                    output_dtype=output_dtype)
    return options
