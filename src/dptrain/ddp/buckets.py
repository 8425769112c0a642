"""Gradient buckets: which parameters share one all-reduce, and the flat buffer they share.

One all-reduce per parameter pays the collective's fixed latency (α) once per tensor;
one all-reduce for the whole model cannot start until the last gradient exists, so
nothing overlaps with backward. Buckets sit between: parameters are grouped, in the
order their gradients become ready (the reverse of registration order, since backward
visits layers last-to-first), into buckets of about ``cap_bytes``, and each bucket is
reduced as soon as its last gradient is ready (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020, section 3.2.3).

A bucket is closed once it reaches the cap, so it may exceed the cap by at most one
parameter, and a parameter larger than the cap gets a bucket of its own. This is
torch DDP's rule too, which keeps "matched bucket sizes" comparisons honest. Buckets
never mix dtypes or devices: a flat buffer has one of each.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ParamInfo", "assign_buckets", "ddp_bucket_layout", "Bucket", "SparseGradient", "copy_into_slice",
           "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_CAP_MB"]

MiB = 1024 * 1024
# torch DDP's defaults: 25 MiB buckets, the first one 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0


@dataclass(frozen=True)
class ParamInfo:
    """What bucket assignment needs to know of a parameter."""

    numel: int
    element_size: int
    dtype: torch.dtype
    device: torch.device
    group: Hashable = None  # parameters of different groups never share a bucket (ZeRO's split_by)

    @classmethod
    def of(cls, param: torch.Tensor) -> ParamInfo:
        return cls(param.numel(), param.element_size(), param.dtype, param.device)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def assign_buckets(
    params: Sequence[ParamInfo],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
    order: Sequence[int] | None = None,
    last_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets, in gradient-ready order.

    ``order`` is the order gradients are expected to become ready; by default the
    reverse of ``params`` (registration order). ``first_cap_bytes`` caps the first
    bucket of each (dtype, device, group) group separately: a small first bucket gets the
    first collective started early. ``last_cap_bytes`` is its mirror: the gradients ready
    last get a bucket of their own of about that size (closed, like every bucket, once it
    reaches the cap), so the one all-reduce that nothing can overlap, started when backward
    ends, carries as little as possible. Returns buckets in launch order, each a list of
    parameter indices in ready order.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    order = list(reversed(range(len(params)))) if order is None else list(order)
    if last_cap_bytes is not None:
        if last_cap_bytes <= 0:
            raise ValueError(f"last bucket cap must be positive, got {last_cap_bytes} bytes")
        last = _last_buckets(params, order, last_cap_bytes)
        taken = {index for bucket in last for index in bucket}
        rest = assign_buckets(params, cap_bytes, first_cap_bytes, [i for i in order if i not in taken])
        return _in_launch_order(_absorb_leftovers(params, rest, last, last_cap_bytes), order)
    first_cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    open_buckets: dict[tuple, tuple[list[int], int]] = {}  # key -> (indices, bytes)
    started: set[tuple] = set()  # keys whose first bucket was already closed
    closed: list[list[int]] = []
    for index in order:
        info = params[index]
        key = (info.dtype, info.device, info.group)
        indices, size = open_buckets.get(key, ([], 0))
        indices.append(index)
        size += info.nbytes
        limit = cap_bytes if key in started else first_cap
        if size >= limit:
            closed.append(indices)
            started.add(key)
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (indices, size)
    closed.extend(indices for indices, _ in open_buckets.values())
    return _in_launch_order(closed, order)


def ddp_bucket_layout(params: Sequence[ParamInfo], bucket_cap_mb: float | None = None,
                      last_bucket_cap_mb: float | None = None) -> list[list[int]]:
    """The DDP engine's buckets: ``bucket_cap_mb=None`` is torch's default (25 MiB, the first bucket 1 MiB);
    an explicit cap applies to the first bucket too, as in torch. ``last_bucket_cap_mb`` (dptrain's, off by
    default) gives the gradients ready last a small bucket of their own. The planner uses the same rule."""
    last = None if last_bucket_cap_mb is None else max(1, int(last_bucket_cap_mb * MiB))
    if bucket_cap_mb is None:
        return assign_buckets(params, int(DEFAULT_BUCKET_CAP_MB * MiB), int(DEFAULT_FIRST_BUCKET_CAP_MB * MiB),
                              last_cap_bytes=last)
    return assign_buckets(params, max(1, int(bucket_cap_mb * MiB)), last_cap_bytes=last)


def _last_buckets(params: Sequence[ParamInfo], order: list[int], cap_bytes: int) -> list[list[int]]:
    """Per (dtype, device, group): the parameters ready last, walking back until ``cap_bytes`` is reached."""
    tails: dict[tuple, tuple[list[int], int]] = {}
    closed: set[tuple] = set()
    for index in reversed(order):
        info = params[index]
        key = (info.dtype, info.device, info.group)
        if key in closed:
            continue
        indices, size = tails.get(key, ([], 0))
        tails[key] = ([index, *indices], size + info.nbytes)
        if size + info.nbytes >= cap_bytes:
            closed.add(key)
    return [indices for indices, _ in tails.values()]


def _absorb_leftovers(params: Sequence[ParamInfo], rest: list[list[int]], last: list[list[int]],
                      cap_bytes: int) -> list[list[int]]:
    """The rest's final bucket of a group, if smaller than the last bucket's cap (a bias left between two
    large weights), joins that group's last bucket rather than paying a collective's latency of its own."""
    def key(index: int) -> tuple:
        info = params[index]
        return info.dtype, info.device, info.group

    final = {key(bucket[0]): n for n, bucket in enumerate(rest)}  # rest is in launch order: the group's final
    merged, dropped = [], set()
    for tail in last:
        n = final.get(key(tail[0]))
        if n is not None and sum(params[i].nbytes for i in rest[n]) < cap_bytes:
            merged.append(rest[n] + tail)
            dropped.add(n)
        else:
            merged.append(tail)
    return [b for n, b in enumerate(rest) if n not in dropped] + merged


def _in_launch_order(buckets: list[list[int]], order: list[int]) -> list[list[int]]:
    # A bucket can launch only once its last parameter is ready, so order buckets by
    # the ready position of their last member; ties cannot happen (disjoint members).
    position = {index: pos for pos, index in enumerate(order)}
    return sorted(buckets, key=lambda bucket: position[bucket[-1]])


class SparseGradient(ValueError):
    """The bucket's parameter at ``position`` has a sparse gradient (buckets are dense)."""

    def __init__(self, position: int):
        super().__init__(f"sparse gradient at bucket position {position}")
        self.position = position


class Bucket:
    """A flat buffer holding the gradients of a group of parameters, back to back.

    ``views[i]`` is ``params[i]``'s slice of the buffer, shaped like the parameter.
    With ``gradient_as_bucket_view`` the parameters' ``.grad`` point at those views,
    so no copy is needed in or out; otherwise gradients are copied in before the
    collective and the reduced values copied back after.
    """

    def __init__(self, index: int, params: list[torch.nn.Parameter], param_indices: list[int]):
        self.index = index
        self.params = params
        self.param_indices = param_indices
        first = params[0]
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.views = self.views_into(self.buffer)

    def views_into(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into another flat buffer of this bucket's size."""
        views, offset = [], 0
        for p in self.params:
            views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def store(self, result: torch.Tensor) -> None:
        """Take a reduction's result: a no-op when it was computed in place."""
        if result is not self.buffer and result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result.view(-1))

    def fill(self, divisor: int | None, as_view: bool, filled: set[int] = frozenset()) -> None:
        """Put the gradients into their slices, divided by ``divisor``; missing gradients as zeros.

        The one way into a bucket, batched: the gradients are sorted into those to copy,
        those that already are their slice (``as_view`` after the first step) and missing
        ones; then one ``_foreach_copy_``, one ``_foreach_zero_`` and one scaling, instead
        of an operation per parameter (on a GPU, a kernel launch each). ``filled``:
        positions copied in as they arrived (:meth:`fill_one`), left alone. The scaling
        multiplies copies by ``1 / divisor`` (the whole buffer when nothing else is in it)
        and divides slices in place, so the result is bitwise that of one
        :func:`copy_into_slice` per parameter (tests/test_ddp_parity.py checks it).
        """
        sources, targets, copied, in_place, zeros = self._sort(as_view, filled)
        if targets:
            torch._foreach_copy_(targets, sources)
            if as_view:  # from now on autograd accumulates into the slice
                for position in copied:
                    self.params[position].grad = self.views[position]
        if zeros:
            torch._foreach_zero_(zeros)
        if divisor is None:
            return
        if in_place is self.views:  # every gradient is its slice
            self.buffer.div_(divisor)
        elif not in_place and not filled:
            self.buffer.mul_(1.0 / divisor)  # zeros stay zeros
        else:
            if targets:
                torch._foreach_mul_(targets, 1.0 / divisor)
            if in_place:
                torch._foreach_div_(in_place, divisor)

    def _sort(self, as_view: bool, filled: set[int]) -> tuple[list, list, Sequence[int], list, list]:
        """(gradients to copy, their slices, their positions, slices that already hold theirs, slices of missing
        gradients).

        The usual step, every gradient present and separate from its slice, is sorted by
        a check at C speed; a loop over the parameters only otherwise.
        """
        grads = [p.grad for p in self.params]
        if not filled and as_view and all(map(operator.is_, grads, self.views)):  # views kept from the last step
            return [], [], (), self.views, []
        if not filled and all(g is not None and not g.is_sparse for g in grads) and \
                not (as_view and any(map(operator.is_, grads, self.views))):
            return grads, self.views, range(len(grads)), [], []
        sources, targets, copied, in_place, zeros = [], [], [], [], []
        for position, (grad, view) in enumerate(zip(grads, self.views, strict=True)):
            if position in filled:
                continue
            if grad is None:
                zeros.append(view)
            elif grad.is_sparse:
                raise SparseGradient(position)
            elif as_view and (grad is view or grad.data_ptr() == view.data_ptr()):  # only a view's can be its slice
                in_place.append(view)
            else:
                sources.append(grad)
                targets.append(view)
                copied.append(position)
        return sources, targets, copied, in_place, zeros

    def fill_one(self, position: int, divisor: int | None, as_view: bool) -> None:
        """Copy one gradient into its slice now (a large one, while it is in cache)."""
        param = self.params[position]
        _check_dense(param, position)
        copy_into_slice(param, self.views[position], divisor, as_view)

    def write_back(self, used: list[bool] | bool, as_view: bool) -> None:
        """Hand the reduced gradients to the parameters whose index ``used`` marks (``True``: all of them).

        The one way out of a bucket. The others (no rank used them since the last sync)
        keep ``.grad`` untouched, as in a single process, so optimizers skip them. With
        ``as_view`` a gradient is its slice (re-pointed if not); otherwise one
        ``_foreach_copy_`` into the existing gradients, and a missing one gets a copy.
        """
        targets, sources = [], []
        grads = [p.grad for p in self.params]
        if used is True and not as_view and all(g is not None for g in grads):  # the usual step: no loop
            targets, sources = grads, self.views
        else:
            for i, param, grad, view in zip(self.param_indices, self.params, grads, self.views, strict=True):
                if used is not True and not used[i]:
                    continue
                if as_view:
                    if grad is not view:  # after the first step it is (autograd accumulates into it)
                        param.grad = view
                elif grad is None:
                    param.grad = view.clone()
                else:
                    targets.append(grad)
                    sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)

    def __repr__(self) -> str:
        return (f"Bucket(index={self.index}, params={len(self.params)}, "
                f"numel={self.numel}, dtype={self.buffer.dtype}, bytes={self.nbytes})")


def _check_dense(param: torch.nn.Parameter, position: int) -> None:
    if param.grad is not None and param.grad.is_sparse:
        raise SparseGradient(position)


def copy_into_slice(param: torch.nn.Parameter, view: torch.Tensor, divisor: int | None, as_view: bool) -> None:
    """Put ``param``'s gradient into its bucket slice ``view``, divided by ``divisor`` (a copy on arrival).

    One pass over memory (``mul`` with an ``out``, as torch's reducer does), not a copy
    and a division. A gradient that already is the slice (``as_view`` with
    ``zero_grad(set_to_none=False)``) is divided in place; with ``as_view`` a separate
    gradient is re-pointed at the slice. A missing gradient contributes zeros.
    """
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.data_ptr() == view.data_ptr():
        if divisor is not None:
            view.div_(divisor)
    else:
        if divisor is not None:
            torch.mul(grad, 1.0 / divisor, out=view)
        else:
            view.copy_(grad)
        if as_view:
            param.grad = view
