"""The communication-hook protocol: how a bucket's gradients travel between ranks.

The DDP engine hands every bucket to a hook the moment the bucket's last gradient is
ready. A hook is any callable ``hook(state, bucket) -> handle`` where

- ``bucket`` is a :class:`GradBucket`: ``bucket.buffer()`` is the flat tensor of the
  bucket's *local, un-averaged* gradients (the hook may modify it in place);
  ``bucket.gradients()`` and ``bucket.parameters()`` are per-parameter views and
  parameters; ``bucket.index()`` and ``bucket.is_last()`` place it in the step;
- ``handle.wait()`` blocks until the reduction is done and returns a flat tensor of
  ``bucket.buffer()``'s size, dtype and device holding the *averaged* gradients.

``torch.futures.Future`` satisfies the handle contract, and ``GradBucket`` offers the
methods torch's own ``GradBucket`` does, so hooks written for
``torch.nn.parallel.DistributedDataParallel.register_comm_hook`` (``allreduce_hook``,
``fp16_compress_hook``, PowerSGD, ...) run here unchanged. The hook owns the
averaging: the engine never divides.

Compression codecs plug in here: encode in the hook, reduce, decode in ``wait()``.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["GradBucket", "CommHook", "ReduceHandle", "allreduce_hook", "hook_name", "stamp", "TimedHandle"]


class ReduceHandle(Protocol):
    def wait(self) -> torch.Tensor: ...


class CommHook(Protocol):
    def __call__(self, state: Any, bucket: "GradBucket") -> ReduceHandle: ...


class GradBucket:
    """A bucket as a communication hook sees it (mirrors ``torch.distributed.GradBucket``)."""

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool):
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Position of this bucket in the step's launch order (0 is reduced first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat, contiguous tensor of this bucket's local gradients."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's contents (torch API compatibility)."""
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into :meth:`buffer`, shaped like the parameters."""
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        """True for the last bucket of the step (hooks with per-step state use it)."""
        return self._is_last


class _WorkHandle:
    """Adapts a ``torch.distributed.Work`` to the handle contract: ``wait()`` returns the tensor."""

    __slots__ = ("_work", "_tensor")

    def __init__(self, work: dist.Work, tensor: torch.Tensor):
        self._work = work
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._tensor

    def is_completed(self) -> bool:
        return self._work.is_completed()


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> ReduceHandle:
    """Average the bucket in place with one asynchronous all-reduce.

    What the engine does when no hook is registered (there, the division is fused into
    the copy of gradients into the bucket); a starting point for hooks that wrap it.
    Dividing before the sum (not after) keeps fp16/bf16 buckets from overflowing.
    """
    tensor = bucket.buffer()
    world_size = dist.get_world_size(process_group)
    if world_size != 1:
        tensor.div_(world_size)
    work = dist.all_reduce(tensor, group=process_group, async_op=True)
    return _WorkHandle(work, tensor)


def hook_name(hook: CommHook) -> str:
    hook = getattr(hook, "func", hook)  # functools.partial
    return getattr(hook, "__qualname__", type(hook).__qualname__)


def stamp(span: list) -> None:
    """Record a reduction's completion time, unless an earlier stamp exists."""
    if span[2] is None:
        span[2] = time.perf_counter()


class TimedHandle:
    """A reduction's handle that stamps its ``[bucket, launched, done]`` span when waited for (an upper bound on
    completion; ``StepCommStats.bucket_spans``)."""

    __slots__ = ("handle", "span")

    def __init__(self, handle: ReduceHandle, span: list):
        self.handle, self.span = handle, span

    def wait(self) -> torch.Tensor:
        result = self.handle.wait()
        done = getattr(self.handle, "completed_at", None)  # dptrain.comm's handles know it exactly
        if done is not None and self.span[2] is None:
            self.span[2] = done
        stamp(self.span)
        return result
