"""The user's parameters stay visible on the wrapped module: their shape, dtype, device and count, no storage.

ZeRO moves every trained parameter into a flat unit (:mod:`dptrain.zero.unit`), and the
module computes with views of the unit's full buffer. Libraries that ask a model about
itself read ``module.parameters()``: transformers' ``model.device`` is
``next(self.parameters()).device`` (read by ``model.train()`` in transformers 5),
``model.dtype`` and ``num_parameters()`` likewise, and so does a user's
``sum(p.numel() for p in model.parameters())``. FSDP2 keeps its sharded parameters on the
module (as DTensors) for the same reason. Here each original ``nn.Parameter`` stays
registered where it was, its data replaced by a **placeholder**: one NaN element expanded
to the parameter's shape (stride 0), so ``shape``, ``numel()``, ``dtype``, ``device`` and
``requires_grad`` are the parameter's while it costs one element of memory. Its values are
NaN, so a computation that reads it by mistake shows it.

The views the module computes with are set in each holder module's instance ``__dict__``
(:func:`set_view`), which Python reads before ``nn.Module.__getattr__`` would reach the
placeholder in ``_parameters``; releasing a stage-3 unit deletes them there again
(:func:`drop_view`), and a read between steps then falls through to ``reads.py``.

A placeholder holds no values, so the module's own ``state_dict()`` and
``load_state_dict()`` would be silently wrong (the bug this replaces: an empty state dict
with no error). They raise instead, naming the way that works (:class:`StateDictGuard`);
ZeRO reads the module's buffers and frozen parameters through :meth:`StateDictGuard.open`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["placeholder", "set_view", "drop_view", "parameter_names", "StateDictGuard"]


def placeholder(param: torch.Tensor) -> torch.Tensor:
    """Data for ``param`` once its values live in a unit: one NaN element, expanded to its shape."""
    return torch.full((), float("nan"), dtype=param.dtype, device=param.device).expand(param.shape)


def parameter_names(root: nn.Module, refs) -> dict[str, list[str]]:
    """Every name under ``root`` of each parameter of ``refs`` (:class:`~dptrain.zero.unit.ParamRef`), by ``ref.name``
    (listed first; a tied parameter has several)."""
    prefixes: dict[int, list[str]] = {}
    for prefix, sub in root.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(sub), []).append(prefix)
    out = {}
    for ref in refs:
        names = [ref.name] + [f"{p}.{attr}" if p else attr for holder, attr in ref.holders
                              for p in prefixes.get(id(holder), [])]
        out[ref.name] = list(dict.fromkeys(names))
    return out


def set_view(module: nn.Module, attr: str, view: torch.Tensor) -> None:
    """``module.attr`` reads ``view`` (an instance attribute, ahead of the placeholder in ``_parameters``)."""
    module.__dict__[attr] = view


def drop_view(module: nn.Module, attr: str) -> None:
    """Forget the view set by :func:`set_view` (the placeholder stays registered)."""
    module.__dict__.pop(attr, None)


_HOW = ("call dptrain.get_state_dict(model) on every rank for the full state dict (the ZeRO wrapper's "
        "full_state_dict() is the same), or save its shards with dptrain.zero.checkpoint.save_sharded")


class StateDictGuard:
    """Makes the wrapped module's ``state_dict()`` / ``load_state_dict()`` raise while its parameters are placeholders.

    ZeRO's own readers of the module's buffers and frozen parameters go through :meth:`open`.
    """

    def __init__(self, module: nn.Module):
        self._open = False
        self._handles = [module.register_state_dict_pre_hook(self._refuse_save),
                         module.register_load_state_dict_pre_hook(self._refuse_load)]

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        self._open = True
        try:
            yield
        finally:
            self._open = False

    def _refuse(self, what: str) -> None:
        if not self._open:
            raise RuntimeError(f"ZeRO shards this model's parameters across ranks, so {what} on the wrapped module "
                               f"would see none of their values; {_HOW}")

    def _refuse_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._refuse("state_dict()")

    def _refuse_load(self, module: nn.Module, *args) -> None:
        self._refuse("load_state_dict()")
