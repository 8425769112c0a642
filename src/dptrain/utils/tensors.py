"""Walking nested containers of tensors: the model's outputs, a batch, a Hugging Face ``BatchEncoding``.

The DDP engine finds its outputs' autograd nodes and moves inputs to the device with
these; the user API (``Engine``, ``prepare()``) moves batches and casts outputs with
them. Both walk tuples, namedtuples, lists, mappings and (for reading) dataclasses.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

__all__ = ["iter_tensors", "map_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists, dicts and dataclasses, without rebuilding them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of nested tuples, namedtuples, lists and mutable mappings with ``fn`` applied to every tensor.

    A mapping is copied and assigned item by item, so its type survives (a Hugging Face
    ``BatchEncoding`` or ``ModelOutput`` keeps its attribute access). Other objects pass
    through unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, MutableMapping):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = map_tensors(value, fn)
        return out
    return obj
