"""The communication-hook protocol: how a bucket's gradients travel between ranks.

The DDP engine hands every bucket to a hook the moment the bucket's last gradient is
ready. A hook is any callable ``hook(state, bucket) -> handle`` where

- ``bucket`` is a :class:`GradBucket`: ``bucket.buffer()`` is the flat tensor of the
  bucket's *local, un-averaged* gradients (the hook may modify it in place);
  ``bucket.gradients()`` and ``bucket.parameters()`` are per-parameter views and
  parameters; ``bucket.index()`` and ``bucket.is_last()`` place it in the step;
- ``handle.wait()`` blocks until the reduction is done and returns a flat tensor of
  ``bucket.buffer()``'s size, dtype and device holding the *averaged* gradients.

``torch.futures.Future`` satisfies the handle contract (dptrain's own hooks return a
:class:`~dptrain.comm.work.Work`), and ``GradBucket`` offers the
methods torch's own ``GradBucket`` does, so hooks written for
``torch.nn.parallel.DistributedDataParallel.register_comm_hook`` (``allreduce_hook``,
``fp16_compress_hook``, PowerSGD, ...) run here unchanged. The hook owns the
averaging: the engine divides only for its default hook, :class:`SumAllReduce`, which
says so (``averages = False``).

Compression codecs plug in here: encode in the hook, reduce, decode in ``wait()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.comm.persistent import PersistentAllReduce
from dptrain.comm.work import Work

__all__ = ["GradBucket", "CommHook", "ReduceHandle", "SumAllReduce", "allreduce_hook", "hook_name"]


class ReduceHandle(Protocol):
    def wait(self) -> torch.Tensor: ...


class CommHook(Protocol):
    def __call__(self, state: Any, bucket: GradBucket) -> ReduceHandle: ...


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
        """Replace the buffer with ``tensor`` (any dtype: ``fp16_compress_wrapper`` hands the hook it wraps an fp16
        copy), as torch's does; the engine copies the hook's result back into the bucket."""
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into :meth:`buffer` (the one :meth:`set_buffer` put, if it did), shaped like the
        parameters."""
        if self._gradients and self._gradients[0].data_ptr() != self._buffer.data_ptr():  # replaced
            views, offset = [], 0
            for g in self._gradients:
                views.append(self._buffer[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            self._gradients = views
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        """True for the last bucket of the step (hooks with per-step state use it)."""
        return self._is_last


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Work:
    """Average the bucket in place with one asynchronous all-reduce.

    A starting point for hooks that wrap it; the engine's default, :class:`SumAllReduce`,
    is the same all-reduce with the division fused into the copy of gradients into the
    bucket. Dividing before the sum (not after) keeps fp16/bf16 buckets from overflowing.
    """
    tensor = bucket.buffer()
    world_size = dist.get_world_size(process_group)
    if world_size != 1:
        tensor.div_(world_size)
    work = dist.all_reduce(tensor, group=process_group, async_op=True)
    return Work(lambda: tensor, backend_work=work)


class SumAllReduce:
    """The engine's default hook: one asynchronous all-reduce of the bucket, a sum.

    As torch's reducer treats its all-reduce as the default comm hook, dptrain's engine
    always calls ``hook(state, bucket)``, and this is the hook it starts with. It does
    not average: the engine divides each gradient by the world size as it copies it into
    the bucket (``averages = False``), one pass over memory fewer than dividing here. Each
    bucket's all-reduce is prepared once, when the engine builds its buckets (:meth:`prepare`;
    :class:`~dptrain.comm.persistent.PersistentAllReduce`), and started with one call to the
    process group, as torch's C++ reducer calls its process group, so a launch inside
    backward runs little Python.
    ``algorithm`` is any of :data:`dptrain.comm.ALGORITHMS`; buckets have the same size
    and dtype on every rank by construction (the replicas were verified), so the
    collective's agreement round trip is skipped. ``timed``: exact completion times
    (``Work.completed_at``) at the cost of a callback per bucket on the backend's thread.
    """

    averages = False

    def __init__(self, group: dist.ProcessGroup, algorithm: str = "native",
                 nodes: int | Sequence[Sequence[int]] | None = None, traffic: comm.Traffic | None = None):
        self.group, self.algorithm, self.nodes, self.traffic = group, algorithm, nodes, traffic
        self.timed = False
        self._prepared: dict[int, PersistentAllReduce] = {}  # bucket index -> its buffer's all-reduce

    def prepare(self, buffers: Sequence[torch.Tensor]) -> None:
        """Prepare the all-reduce of each bucket's own buffer (bucket ``i``'s is ``buffers[i]``), once."""
        self._prepared = {i: PersistentAllReduce(buffer, algorithm=self.algorithm, group=self.group, nodes=self.nodes,
                                                 traffic=self.traffic, validate=False)
                          for i, buffer in enumerate(buffers)}

    def __call__(self, state: Any, bucket: GradBucket) -> Work:
        """Start the bucket's prepared all-reduce; any other buffer (a joined rank's zeros) through
        ``comm.all_reduce``, prepared for that call only."""
        buffer = bucket.buffer()
        prepared = self._prepared.get(bucket.index())
        if prepared is not None and prepared.tensor is buffer:
            return prepared.start(self.timed)
        return comm.all_reduce(buffer, algorithm=self.algorithm, group=self.group, nodes=self.nodes,
                               async_op=True, validate=False, traffic=self.traffic, timed=self.timed)


def hook_name(hook: CommHook) -> str:
    hook = getattr(hook, "func", hook)  # functools.partial
    return getattr(hook, "__qualname__", type(hook).__qualname__)
