"""The autograd plumbing the DDP engine needs, kept in one place.

[Note: finalize on the outermost backward]
The engine must wait for its in-flight bucket reductions once the *whole* backward is
done, before ``optimizer.step()`` can read ``.grad``. Autograd offers one place for
that: a callback queued on the running graph task, which runs after the task's last
node. Queueing it from a parameter's gradient hook, as is natural, goes wrong under
reentrant activation checkpointing: the checkpointed segment's parameters get their
gradients inside a *nested* backward (a separate graph task), so a callback queued
there runs when the nested task ends, long before the outer backward is done. This is
the root of torch DDP's "Expected to mark a variable ready only once" failures.

dptrain instead passes the module's outputs through :class:`_BackwardSink`, an
identity whose backward runs first in the outermost graph task (it consumes the
loss's gradient before anything else) and queues the finalize callback there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch.autograd import Variable

__all__ = ["sink_outputs", "queue_on_current_backward", "reachable_params", "map_tensors"]


def queue_on_current_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the currently running graph task finishes.

    Wraps the one private autograd API dptrain uses (``_execution_engine.queue_callback``),
    which torch DDP and FSDP rely on for the same purpose; exceptions raised by the
    callback propagate out of ``loss.backward()``.
    """
    Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


class _BackwardSink(torch.autograd.Function):
    """Identity on the module's outputs; its backward calls ``on_backward`` first."""

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)  # unused outputs keep a None gradient
        ctx.on_backward = on_backward
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.on_backward()
        return (None, *grads)


def sink_outputs(output: Any, on_backward: Callable[[], None]) -> Any:
    """Return ``output`` with its grad-requiring tensors routed through a backward sink.

    The autograd graph holds ``on_backward`` until it is freed; a callback that refers to
    large state should hold it through a weak reference.
    """
    tensors: list[torch.Tensor] = []
    map_tensors(output, lambda t: tensors.append(t) or t)
    needs_grad = [t for t in tensors if t.requires_grad]
    if not needs_grad:
        return output
    sunk = iter(_BackwardSink.apply(on_backward, *needs_grad))
    return map_tensors(output, lambda t: next(sunk) if t.requires_grad else t)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, dicts and dataclasses, in order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    return obj


def reachable_params(outputs: Iterable[torch.Tensor]) -> set[int]:
    """``id()`` of every leaf tensor whose gradient the outputs' graph will accumulate.

    A breadth-first walk over ``grad_fn.next_functions`` to the ``AccumulateGrad``
    nodes. Parameters inside a reentrant checkpoint are hidden behind the checkpoint's
    node and so are not found; callers must not treat "unreachable" as "certainly
    unused" without other evidence.
    """
    seen: set[Any] = set()
    frontier = [t.grad_fn for t in outputs if t.grad_fn is not None]
    found: set[int] = set()
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return found
