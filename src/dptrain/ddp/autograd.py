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

dptrain instead registers a pre-hook on the autograd nodes that produced the module's
outputs (:func:`on_backward_reaching`). The outputs feed the loss, so those nodes run
in the outermost graph task, before any parameter gradient exists; the pre-hook queues
the finalize callback there. The outputs themselves are returned untouched: no wrapper
node, no rebuilt containers, in-place operations on them work as without DDP.

A pre-hook also fires for backward passes that produce no parameter gradient at all,
such as ``torch.autograd.grad(out.sum(), x, create_graph=True)`` for a gradient penalty.
:func:`will_accumulate` tells those apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd import Variable

from dptrain.utils.tensors import (  # map_tensors re-exported for old imports
    iter_tensors,
    map_tensors,
)

__all__ = ["on_backward_reaching", "queue_on_current_backward", "will_accumulate", "grad_accumulator",
           "reachable_params", "iter_tensors", "map_tensors"]


def queue_on_current_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the currently running graph task finishes.

    Exceptions raised by the callback propagate out of ``loss.backward()``. Uses the
    engine's ``queue_callback``, private but relied on by torch DDP and FSDP for the
    same purpose.
    """
    Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def grad_accumulator(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node autograd uses for ``param`` (kept alive by the caller)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def will_accumulate(accumulators: Iterable[Any]) -> bool:
    """Inside a backward pass: will it write ``.grad`` of any of these accumulators' leaves?

    Wraps ``torch._C._will_engine_execute_node``, private but used by torch's own
    ``torch.autograd.graph.register_multi_grad_hook`` for the same question.
    """
    return any(torch._C._will_engine_execute_node(node) for node in accumulators)


def on_backward_reaching(output: Any, callback: Callable[[], None]) -> bool:
    """Call ``callback`` when a backward pass reaches any grad-requiring tensor of ``output``.

    Registers a pre-hook on each distinct autograd node that produced such a tensor.
    The graph holds ``callback`` until it is freed, so a callback that refers to large
    state should hold it through a weak reference. Returns False if no tensor in
    ``output`` has an autograd node (nothing to hook).
    """
    nodes = {id(t.grad_fn): t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(lambda grad_outputs: callback())
    return bool(nodes)


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
