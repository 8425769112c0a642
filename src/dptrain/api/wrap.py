"""A model wrapped for data parallelism through the strategy registry, with the user API's precision and options.

``Engine`` and ``prepare()`` name a strategy, a precision and the strategy's options; the
registry entry wraps the model (:class:`~dptrain.strategies.registry.Strategy`), and its
facts decide how precision is applied, never its name:

- a wrapper that casts the module itself (``casts_itself``: ZeRO, from fp32 master shards)
  gets the precision and builds its own mixed precision; there is no autocast;
- the others run the forward under ``torch.autocast`` (:func:`autocast_dtype`).

Options are one argument, ``options=``: the strategy's options object (the policy its
package defines) or a dict of its wrapper's keyword arguments. The keywords the user
API took before (``ddp_kwargs=``, ``zero_kwargs=``, ``gossip_kwargs=``) still work: the one
the entry names (``options_argument``) is its options.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.strategies.registry import Strategy, get_strategy

__all__ = ["wrap_model", "autocast_dtype", "options_for", "user_api_entry"]

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def user_api_entry(name: str, api: str) -> Strategy:
    """The registry entry for ``name`` as ``Engine`` and ``prepare()`` (``api``) take it: one whose wrapper the
    registry builds; a strategy that runs its own program is refused, saying why (a ValueError, one line)."""
    entry = get_strategy(name)  # unknown: a ValueError with a did-you-mean
    if entry.wrap is None:
        raise ValueError(f"strategy {entry.name!r} cannot run inside {api}: its ranks run different programs (its "
                         "own loop): dptrain run only")
    return entry


def wrap_model(entry: Strategy, model: nn.Module, *, precision: str, process_group: dist.ProcessGroup | None,
               options: Any, output_dtype: torch.dtype | None = None) -> nn.Module:
    """``entry.wrap(model, ...)`` with ``options``; ``output_dtype``: what a self-casting wrapper returns in."""
    autocast_dtype(entry, precision)  # an unknown precision is named before anything is built
    return entry.wrap(model, process_group=process_group, options=options, precision=precision,
                      output_dtype=output_dtype)


def autocast_dtype(entry: Strategy, precision: str) -> torch.dtype | None:
    """The dtype to autocast the forward to, None where the wrapper casts the module itself or for fp32."""
    if precision not in _AUTOCAST:
        raise ValueError(f"unknown precision {precision!r}; use fp32, bf16 or fp16")
    return None if entry.casts_itself else _AUTOCAST[precision]


def options_for(entry: Strategy, options: Any = None, **legacy: dict | None) -> Any:
    """``options=``, or the legacy keyword ``entry`` took its options by (``ddp_kwargs=``...); both is an error."""
    given = {name: value for name, value in legacy.items() if value is not None}
    mine = given.get(entry.options_argument) if entry.options_argument else None
    if options is not None and mine is not None:
        raise TypeError(f"pass strategy {entry.name}'s options once: options= or {entry.options_argument}=, not both")
    return options if options is not None else mine
