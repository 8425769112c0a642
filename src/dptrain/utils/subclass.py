"""A subclass of a library's class that never runs the base's ``__init__``: each name of the base reviewed.

[Note: a subclass of torch's DDP that never runs torch's __init__] (``dptrain/ddp/torch_class.py``)
is the reason: code asks ``isinstance(model, torch.nn.parallel.DistributedDataParallel)``, so a
class can be a real subclass of torch's to be seen as one, while torch's methods read state
only torch's ``__init__`` creates. Every name the base defines is then, by name, overridden,
inherited on purpose, or **refused**: reading it raises ``AttributeError`` saying what to use
instead (so ``hasattr`` is False). A name a later version of the base adds is refused until
reviewed (default deny), never silently inherited.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Refused", "refuse_unreviewed", "overridden", "own_names"]

# Class plumbing that is not behaviour.
_PLUMBING = {"__module__", "__doc__", "__annotations__", "__dict__", "__weakref__", "__abstractmethods__",
             "_abc_impl", "__firstlineno__", "__static_attributes__", "__qualname__", "__parameters__",
             "__orig_bases__", "__annotate__", "__annotate_func__", "__annotations_cache__"}


class Refused:
    """A name of the base that the subclass does not offer: reading it from an instance raises AttributeError."""

    def __init__(self, owner: str, base: str, name: str, instead: str):
        self.owner, self.base, self.name, self.instead = owner, base, name, instead

    @property
    def message(self) -> str:
        return f"{self.owner} does not offer {self.base}'s {self.name!r}: {self.instead}"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(self.message)


def own_names(base: type) -> list[str]:
    """Every name ``base`` defines itself, less class plumbing."""
    return [name for name in vars(base) if name not in _PLUMBING]


def overridden(cls: type, base: type) -> set[str]:
    """The names ``cls`` or a class before ``base`` in its MRO (a mixin) defines."""
    mro = cls.__mro__
    return {name for c in mro[:mro.index(base)] for name, value in vars(c).items() if not isinstance(value, Refused)}


def refuse_unreviewed(cls: type, base: type, *, owner: str, base_name: str, inherited: dict[str, str],
                      refused: dict[str, str], default: str) -> type:
    """Every name of ``base`` that ``cls`` neither overrides nor inherits on purpose (``inherited``) is refused:
    with ``refused[name]`` as what to do instead, else ``default``."""
    for name in own_names(base):
        if name in overridden(cls, base) or name in inherited:
            continue
        setattr(cls, name, Refused(owner, base_name, name, refused.get(name, default)))
    return cls
