"""Stage 3: a parameter read outside its unit's forward gathers its unit there.

Code may read a unit's parameter outside that unit's forward: a parent that computes
its output head as ``h @ self.embed.weight.t()`` with the embedding listed as a unit, a
positional table read by the top module. A released unit's parameters are not
attributes of their modules, so Python falls back to the class's ``__getattr__``: each
holder module's class is swapped for a subclass of the same name (FSDP2 swaps in
``FSDP<Class>`` likewise) whose ``__getattr__`` asks ``ZeRO.read_outside_unit`` for the
parameter. Inside the forward that gathers the unit, every rank alike since every rank
runs the same code, and keeps it to the end of forward; between steps it is an error
that names ``gathered_state()``.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import nn

from dptrain.zero.unit import FlatUnit

__all__ = ["ReadsOutsideUnit", "gather_on_read"]


class ReadsOutsideUnit(Protocol):
    """What answers a read of a released unit's parameter: ``ZeRO``, named here by its method alone so
    that this module needs no import of ``module.py`` (which imports this one)."""

    def read_outside_unit(self, unit: FlatUnit, module: nn.Module, attr: str, name: str) -> torch.Tensor: ...


def gather_on_read(module: nn.Module, attr: str, zero: ReadsOutsideUnit, unit: FlatUnit, name: str) -> None:
    """Stage 3: make reading ``module.attr`` while its unit is released gather the unit (``ZeRO.read_outside_unit``).

    A released unit's parameters are not attributes of their modules, so Python falls
    back to the class's ``__getattr__``. The module's class is swapped for a subclass
    (same name, made once per class, as FSDP2 swaps in ``FSDP<Class>``) whose
    ``__getattr__`` looks the name up in the module's own table first.
    """
    cls = type(module)
    if not getattr(cls, "_zero_gathers_on_read", False):
        module.__class__ = _GATHERING_CLASSES.get(cls) or _gathering_class(cls)
    reads = module.__dict__.setdefault("_zero_reads", {})
    reads[attr] = (weakref.ref(zero), unit, name)


_GATHERING_CLASSES: dict[type, type] = {}


def _gathering_class(cls: type) -> type:
    def __getattr__(self, attr: str):
        entry = self.__dict__.get("_zero_reads", {}).get(attr)
        if entry is not None:
            zero = entry[0]()
            if zero is not None:
                return zero.read_outside_unit(entry[1], self, attr, entry[2])
        return super(swapped, self).__getattr__(attr)

    swapped = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "_zero_gathers_on_read": True,
                                          "__qualname__": cls.__qualname__, "__module__": cls.__module__})
    _GATHERING_CLASSES[cls] = swapped
    return swapped
