"""What ``torch.compile`` needs of a DDP wrapper, in one place (it uses private dynamo and DDP APIs: STYLE item 8).

[Note: compiled graphs split at bucket boundaries]
AOTAutograd turns a compiled region into one autograd node, whose backward produces every
parameter gradient of the region at once, when the region's whole backward is done. A
reducer that launches a bucket's all-reduce as its gradients land would then launch them
all at the end: nothing overlaps. Dynamo's DDPOptimizer (``torch/_dynamo/backends/distributed.py``)
splits the graph it compiles into pieces of about ``bucket_bytes_cap`` bytes of parameters,
counted in reverse graph order (the first piece 1 MiB), and compiles each piece on its own:
each is an autograd node, so its parameters' gradients land, and their buckets launch,
while the earlier pieces' backward still runs. Dynamo engages it only for a frame it
compiles while ``torch.nn.parallel.DistributedDataParallel._active_ddp_module`` is set (torch's
forward sets it around the module's call, ``_inside_ddp_forward``), and it reads that
module's ``bucket_bytes_cap`` (``torch/_dynamo/convert_frame.py``). dptrain's wrapper sets it
the same way, around the same call (:func:`run_module`).

The two orders of wrapping:

- ``DDP(torch.compile(model))`` (nanoGPT's): the wrapper's forward runs eagerly; the
  compiled model's frame is compiled inside :func:`run_module`, so it is split.
- ``torch.compile(DDP(model))``: dynamo starts at the wrapper. Its own work (the buffer
  broadcast, ``Join``'s collectives, the reducer's bookkeeping, a pre-hook on the outputs'
  autograd nodes) is Python that dynamo cannot put in a graph, so it is kept out whole:
  :func:`eager` on those steps, and the wrapper's ``forward`` itself is a frame dynamo
  skips (:func:`skip_frame`), calling the module as a frame of its own, compiled while the
  wrapper is the active DDP module: split. No graph break (torch's class has three: its
  logger call and, twice, its ``_inside_ddp_forward``); a compiled function that calls the
  wrapped model breaks once, where it calls it.

DDPOptimizer asserts that its first piece (1 MiB, ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)
is no larger than the others: torch's class compiled with ``bucket_cap_mb`` under 1 raises
``AssertionError``. dptrain's ``bucket_bytes_cap`` is therefore at least 1 MiB
(:func:`split_bytes`): buckets smaller than that are launched several to a piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

__all__ = ["TorchDDP", "eager", "skip_frame", "run_module", "split_bytes"]

F = TypeVar("F", bound=Callable[..., Any])

# torch's class, as imported before anything could patch the name (torch's conformance suite puts dptrain's
# class in its place): dynamo reads the active module from this one.
TorchDDP = torch.nn.parallel.distributed.DistributedDataParallel

_FIRST_PIECE_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES if dist.is_available() else 1024 * 1024


def eager(fn: F) -> F:
    """``fn`` and everything it calls run eagerly, never traced by dynamo (:func:`_mark`)."""
    return _mark(fn, _FrameAction.SKIP)


def skip_frame(fn: F) -> F:
    """Dynamo never traces ``fn``'s own frame, but compiles the frames it calls as usual (:func:`_mark`)."""
    return _mark(fn, _FrameAction.DEFAULT)


def _mark(fn: F, callees: _FrameAction) -> F:
    """What ``torch._dynamo.skip`` does, without importing dynamo (1.5 s) or wrapping ``fn`` (a frame a call):
    dynamo skips ``fn``'s frames (and, with ``callees`` SKIP, the frames they call), a mark on its code object
    read by dynamo's frame hook; and dynamo tracing a caller does not inline it (``_torchdynamo_disable``) but
    calls it, so it runs as a frame of its own, skipped. Private to torch; used by ``torch._dynamo.skip``."""
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, callees))
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    return fn


@skip_frame
def run_module(ddp: nn.Module, module: nn.Module, inputs: tuple, kwargs: dict) -> Any:
    """``module(*inputs, **kwargs)`` with ``ddp`` as torch's active DDP module: a graph compiled here is split at
    bucket boundaries ([Note: compiled graphs split at bucket boundaries]). Nested wrappers restore the outer."""
    outer = TorchDDP._active_ddp_module
    TorchDDP._active_ddp_module = ddp
    try:
        return module(*inputs, **kwargs)
    finally:
        TorchDDP._active_ddp_module = outer


def split_bytes(bucket_cap_mb: float | None, default_mb: float) -> int:
    """``bucket_bytes_cap``: the bucket size in bytes, as torch's attribute, but at least DDPOptimizer's first piece
    (1 MiB), which it asserts is no larger than the others."""
    cap = int((default_mb if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    return max(cap, _FIRST_PIECE_BYTES)
