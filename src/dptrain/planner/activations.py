"""Activation memory from a traced forward of one micro-batch on the meta device.

Autograd keeps, between a forward and its backward, every tensor an operation saved
for its gradient: that is a step's activation memory. The planner runs the model's
forward and loss on meta tensors (no data, no compute, any size) under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct storages saved,
less the parameters' and buffers' (they are model state, counted apart). Views share
their base's storage and count once, as in real memory.

With activation checkpointing of some module classes (e.g. the transformer block),
a checkpointed module keeps only its inputs, and in backward recomputes its forward,
holding one module's activations at a time. So the checkpointed estimate is: what is
saved outside those modules, plus their inputs, plus the largest one module saves.
A forward that fails on the meta device (data-dependent control flow, ``.item()``,
an operation without a meta kernel) raises :class:`ActivationTraceError` naming the
failure, rather than giving a wrong number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptrain.utils.modules import outermost

__all__ = ["Activations", "ActivationTraceError", "trace_activations"]


class ActivationTraceError(RuntimeError):
    """The model's forward could not be traced on the meta device."""


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for backward after one micro-batch's forward (parameters excluded).

    ``saved``: without checkpointing; ``checkpointed``: with each module of the
    checkpointed classes recomputed in backward (None when the model has none);
    ``largest``: the largest single saved storage; ``units``: how many checkpointed
    modules were found.
    """

    saved: int
    checkpointed: int | None
    largest: int
    units: int


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def trace_activations(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                      checkpoint_classes: tuple[type, ...] = ()) -> Activations:
    """Trace ``loss_fn(model, batch)`` on the meta device and count the saved tensors' bytes."""
    model_state = {_key(t) for t in list(model.parameters()) + list(model.buffers())}
    owners: dict[int, int | None] = {}  # storage -> the checkpointed module saving it (None: outside)
    sizes: dict[int, int] = {}
    inputs: dict[int, int] = {}  # storages entering checkpointed modules
    stack: list[int] = []
    modules = outermost(model, checkpoint_classes) if checkpoint_classes else []
    handles = []
    for index, module in enumerate(modules):
        def pre(mod, args, index=index):
            stack.append(index)
            for a in args:
                if torch.is_tensor(a):
                    inputs.setdefault(_key(a), a.untyped_storage().nbytes())

        def post(mod, args, output):
            stack.pop()  # returns None: the output stays as it is

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in model_state and key not in sizes:
            sizes[key] = t.untyped_storage().nbytes()
            owners[key] = stack[-1] if stack else None
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(model, batch)
    except Exception as e:  # any failure of the user's forward on meta tensors
        raise ActivationTraceError(
            f"could not trace the forward without data (fake or meta tensors) to estimate activations: "
            f"{type(e).__name__}: {e}. "
            "Activations are left out of the plan; model states and communication do not need the trace") from e
    finally:
        for h in handles:
            h.remove()
    saved = sum(sizes.values())
    checkpointed = None
    if modules:
        per_module = [0] * len(modules)
        outside = 0
        for key, nbytes in sizes.items():
            if owners[key] is None:
                outside += nbytes
            else:
                per_module[owners[key]] += nbytes
        entering = sum(nbytes for key, nbytes in inputs.items() if owners.get(key, -1) is not None)
        checkpointed = outside + entering + max(per_module)
    return Activations(saved=saved, checkpointed=checkpointed, largest=max(sizes.values(), default=0),
                       units=len(modules))
