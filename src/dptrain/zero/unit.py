"""A flat unit: a group of parameters stored as one flat buffer, sharded across ranks.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020) keeps on each rank only a 1/N shard of what data
parallelism replicates. dptrain's unit of sharding is a *flat unit*: the parameters of
a bucket (stages 1-2) or of a wrapped module (stage 3) laid end to end in one 1-D
buffer, split into the shards of :func:`~dptrain.comm.topology.shard_bounds` (rank r
owns elements ``[lo_r, hi_r)``; the first ``numel % N`` shards are one longer, no
padding). Rank r's slice is the ``shard`` Parameter the optimizer sees.

How the module computes with a unit: before the unit's forward, :meth:`FlatUnit.materialize`
produces the full flat buffer through :class:`_Unshard`, an autograd function whose
input is the shard and whose output is the full buffer, splits it into per-parameter
views and sets them on the modules as plain attributes. Autograd sums the views'
gradients into one full-size gradient of the buffer (``split_with_sizes``'s backward is
one concatenation) and calls ``_Unshard.backward`` exactly once, when the last of the
unit's parameters has its gradient: the unit's "bucket is ready" moment. There the
unit starts its reduce-scatter asynchronously (its :class:`~dptrain.zero.reduction.UnitReduction`),
so it overlaps with the rest of backward, and :meth:`FlatUnit.finish` collects it when
backward is done.

What each stage keeps between steps (Ψ parameters of 4 bytes, fp32):

========  ===================  ========================  ==============
stage     parameters           gradients                 formula
========  ===================  ========================  ==============
1         full buffer (4Ψ)     full local buffer (4Ψ);    (8 + 8/N)Ψ
                               the shard's slice reduced
2         full buffer (4Ψ)     the shard only (4Ψ/N)      (4 + 12/N)Ψ
3         the shard only       the shard only             16Ψ/N
========  ===================  ========================  ==============

plus the optimizer's state for the shard (Adam: 8Ψ/N). Stage 1 accumulates local
gradients in its full buffer across micro-batches and reduce-scatters the sum on the
synchronising backward; stages 2 and 3 reduce-scatter every backward and accumulate
shards.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dptrain import comm
from dptrain.zero.hybrid import ShardGroups
from dptrain.zero.policy import CommPolicy, ShardingPolicy
from dptrain.zero.precision import MixedPrecision
from dptrain.zero.reduction import CommContext, UnitReduction
from dptrain.zero.timing import start_timing
from dptrain.zero.visible import drop_view, set_view

__all__ = ["ParamRef", "FlatUnit"]


@dataclass(eq=False)
class ParamRef:
    """One parameter of a unit: its qualified name, shape, every (module, attribute) holding it, the tensor."""

    name: str
    shape: torch.Size
    holders: tuple[tuple[nn.Module, str], ...]
    tensor: torch.Tensor

    @property
    def numel(self) -> int:
        return self.shape.numel()


class _Unshard(torch.autograd.Function):
    """Shard -> full buffer in forward; the full buffer's gradient -> the unit's reduction in backward."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, full: torch.Tensor, unit: FlatUnit) -> torch.Tensor:
        ctx.unit = unit
        return full.view(full.shape)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.unit.reduce(grad_full)
        return None, None, None


class FlatUnit:
    """Parameters flattened into one buffer, of which this rank owns the slice ``[lo, hi)``.

    Built complete from explicit arguments: ``refs`` and ``full`` (the flat buffer,
    identical on every rank), ``owner`` (stage 3's unit module, None for the root unit
    and stages 1-2), ``key`` (``split_by``'s), the groups, the policies and the
    ``context`` shared with the model's other units. Nothing is set from outside later;
    ``require_sync`` is switched by ``ZeRO.no_sync``.
    """

    def __init__(self, index: int, refs: list[ParamRef], full: torch.Tensor, *, stage: int,
                 owner: nn.Module | None, key: Hashable, groups: ShardGroups, communication: CommPolicy,
                 sharding: ShardingPolicy, precision: MixedPrecision | None, context: CommContext):
        self.index, self.refs, self.stage, self.owner, self.key = index, refs, stage, owner, key
        self.context = context
        # hybrid sharding (zero/hybrid.py): ``groups.shard`` is the group this unit is sharded over; each reduced
        # shard is then averaged over ``groups.replicate``, the ranks holding the same shard
        self.group, self.replicate_group = groups.shard, groups.replicate
        self.algorithm, self.nodes = communication.algorithm, communication.nodes
        self._comm = dict(algorithm=self.algorithm, group=self.group, nodes=self.nodes, validate=False,
                          traffic=communication.traffic)
        self.numel = full.numel()
        self._set_dtypes(full.dtype, precision)
        self.device = full.device
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.lo, self.hi = comm.shard_range(self.numel, self.world_size, self.rank)
        self.reshard_after_forward = sharding.reshards and owner is not None and stage == 3
        self.full, self.shard = self._split_full(full)
        self.shard._zero_unit = self  # lets LARS/LAMB and checkpoints find the layout
        self.reduction = UnitReduction(index, self.numel, (self.lo, self.hi), self.reduce_dtype, self.device,
                                       groups, communication, context)
        self._init_gradient_state(sharding.find_unused_parameters)
        self.stale = False  # the shard changed since the full buffer was gathered
        self._gathering: comm.Work | None = None
        self.require_sync = True

    @property
    def check(self):
        """The collective check shared by the model's units (None: off); ``context.check``."""
        return self.context.check

    def _set_dtypes(self, master: torch.dtype, precision: MixedPrecision | None) -> None:
        """master: the shard the optimizer steps; compute: the full buffer and its gradient; reduce: the
        reduce-scatter (see zero/precision.py)."""
        self.master_dtype = master
        self.compute_dtype = (precision.param_dtype if precision is not None else None) or master
        self.reduce_dtype = (precision.reduce_dtype if precision is not None else None) or self.compute_dtype

    def _split_full(self, full: torch.Tensor) -> tuple[torch.Tensor | None, nn.Parameter]:
        """(the full buffer kept between steps, the shard Parameter); stage 3 keeps no full buffer."""
        if self.stage < 3 and self.compute_dtype == self.master_dtype:
            return full, nn.Parameter(full[self.lo:self.hi])  # the shard shares the full buffer's storage
        shard = nn.Parameter(full[self.lo:self.hi].clone())
        return (full.to(self.compute_dtype) if self.stage < 3 else None), shard

    def _init_gradient_state(self, defer: bool) -> None:
        """The gradient side's state; ``defer``: ``find_unused_parameters`` ([Note: units some ranks skip])."""
        stage = self.stage
        # stage 1 accumulates full local gradients; its shard's gradient is a view of them
        # when no cast separates the two
        self.full_grad = torch.zeros(self.numel, dtype=self.reduce_dtype, device=self.device) if stage == 1 else None
        self._grad_is_view = stage == 1 and self.reduce_dtype == self.master_dtype
        # stage 1 accumulates in place when autograd's gradients can live in full_grad
        self.accumulates_in_place = stage == 1 and self.reduce_dtype == self.compute_dtype
        self._accumulated = False
        # Stage 1 in place: gradient arrivals since the last reduction. Once every rank has
        # seen each parameter's gradient arrive in one piece (one AccumulateGrad call per
        # forward), the unit is reduced as soon as its last parameter's gradient is in,
        # overlapping the rest of backward; until then (and for good if a gradient came in
        # pieces, as under reentrant checkpointing) it is reduced when backward is done.
        # Deferred reductions wait for the end of backward anyway: never single-piece.
        self._waiting = self._pieces = self._forwards = 0
        self.single_piece: bool | None = False if defer else None
        self._unsynced: torch.Tensor | None = None  # stages 2-3: local gradients under no_sync
        self._fresh_cycle, self._has_local = True, False  # stage 1: the local accumulation's state
        self._carry: torch.Tensor | None = None
        # find_unused_parameters: reductions wait for the end of backward, where every rank issues one per
        # unit in index order (skipped.reduce_in_order); this holds the gradient until then
        self.defer = defer
        self._deferred: torch.Tensor | None = None

    # ------------------------------------------------------------------ parameters

    def offsets(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each parameter in the flat buffer."""
        out, offset = [], 0
        for ref in self.refs:
            out.append((offset, offset + ref.numel))
            offset += ref.numel
        return out

    def gather(self, async_op: bool = False) -> None:
        """Bring the full buffer up to date from every rank's shard (stage 3: allocate it)."""
        if self._gathering is not None or (self.full is not None and not self.stale):
            return
        if self.full is None:
            self.full = torch.empty(self.numel, dtype=self.compute_dtype, device=self.device)
        self.stale = False
        with torch.no_grad():
            source = self.shard.detach().to(self.compute_dtype)  # the shard itself when no cast is needed
            check = self.context.check
            if check is not None:  # the full buffer only: shards differ by one element where numel is uneven
                check.verify_site(("gather", self.index), "all_gather", [self.full], f"unit {self.index}")
            launched = time.perf_counter()
            work = comm.all_gather(self.full, source, async_op=True, **self._comm)
        work = start_timing(work, self.context.step_comm, "all-gather", self.index, self.full, launched)
        if async_op:
            self._gathering = work
        else:
            work.wait()

    def wait_gathered(self) -> torch.Tensor:
        self.gather()
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None
        return self.full

    def materialize(self, differentiable: bool = True) -> torch.Tensor:
        """Set every parameter on its modules as a view of the full buffer; returns the buffer's autograd output.

        ``differentiable=False`` sets plain views, outside autograd (stages 1-2 set those
        at the start of forward and the differentiable ones when a holder module runs).
        """
        full = self.wait_gathered()
        differentiable = differentiable and torch.is_grad_enabled() and self.shard.requires_grad
        if differentiable and self.accumulates_in_place:
            return self._materialize_leaves(full)
        if differentiable:
            out = _Unshard.apply(self.shard, full, self)
            if self.require_sync:
                self.reduction.expect_piece()
        else:
            out = full.view(full.shape)
        parts = out.split([r.numel for r in self.refs])
        if differentiable:
            # Just before autograd concatenates the unit's gradients into a new full-size
            # tensor, let the previous reduction finish and drop its input (FSDP2 waits
            # for the previous reduce-scatter at the same point): one full-size gradient
            # fewer at the peak, and the previous reduction still overlapped this unit's
            # backward.
            parts[0].grad_fn.register_prehook(self._before_concat)
        for ref, view in zip(self.refs, parts, strict=True):
            view = view.view(ref.shape)
            for module, attr in ref.holders:
                set_view(module, attr, view)
        return out

    def _before_concat(self, grad_outputs):
        self.context.reductions.make_room()

    def _materialize_leaves(self, full: torch.Tensor) -> torch.Tensor:
        """Stage 1: every parameter a leaf whose ``.grad`` is preset to its slice of ``full_grad``.

        Autograd then accumulates each parameter's gradient in place into the unit's
        full gradient buffer (as torch's DDP does with ``gradient_as_bucket_view``): no
        per-parameter gradient tensors and no concatenation. The reduce-scatter of the
        accumulated buffer (:meth:`reduce_accumulated`) starts when the unit's last
        gradient is in (:meth:`_arrived`), or when backward is done.
        """
        if self._fresh_cycle:  # a new accumulation: keep the reduced gradient the user has not consumed
            self._carry = self.shard.grad.clone() if self.shard.grad is not None else None
            self.full_grad.zero_()
            self._fresh_cycle = False
        sizes = [r.numel for r in self.refs]
        for ref, view, grad in zip(self.refs, full.split(sizes), self.full_grad.split(sizes), strict=True):
            leaf = view.view(ref.shape).detach().requires_grad_(True)
            leaf.grad = grad.view(ref.shape)
            leaf.register_post_accumulate_grad_hook(self._arrived)
            for module, attr in ref.holders:
                set_view(module, attr, leaf)
        self._accumulated = True
        self._waiting += len(self.refs)
        self._forwards += 1
        return full

    def _arrived(self, leaf: torch.Tensor) -> None:
        """A parameter's gradient was accumulated; with single-piece gradients the unit's last one reduces it."""
        self._waiting -= 1
        self._pieces += 1
        if not (self.single_piece and self.require_sync):
            return
        if self._waiting == 0:
            self.reduce_accumulated()
        elif self._waiting < 0:
            raise RuntimeError(
                f"ZeRO stage 1: a gradient of unit {self.index} (parameters {self.refs[0].name}, ...) arrived after "
                "the unit's reduction had started: on earlier steps each parameter's gradient came in one piece, "
                "now in several (e.g. reentrant activation checkpointing switched on mid-run). Keep the autograd "
                "graph's shape the same from step to step")

    def reduce_accumulated(self) -> None:
        """Stage 1, after a synchronising backward: reduce-scatter the accumulated full gradient."""
        if not self._accumulated:
            return
        if self.single_piece is None:  # learnt at the first reduction, agreed by every rank
            local = torch.tensor([int(self._pieces <= len(self.refs) * self._forwards)], device=self.device)
            for group in (self.group, self.replicate_group) if self.world_size > 1 else (self.replicate_group,):
                if group is not None:  # every rank agrees, replicas included
                    dist.all_reduce(local, op=dist.ReduceOp.MIN, group=group)
            self.single_piece = bool(local.item())
        self._accumulated = False
        self._waiting = self._pieces = self._forwards = 0
        self._launch(self.full_grad)

    def release(self, force: bool = False) -> None:
        """Stage 3: drop the full buffer (the modules' views with it) until the next gather.

        Units that reshard after forward are released after forward and after their
        reduction; the others (``force``) when backward is done.
        """
        if self.stage < 3 or self.full is None or not (force or self.reshard_after_forward):
            return
        for ref in self.refs:
            for module, attr in ref.holders:
                drop_view(module, attr)
        self.full = None

    # ------------------------------------------------------------------ gradients

    def reduce(self, grad_full: torch.Tensor) -> None:
        """Called from backward with the full buffer's gradient: start its reduce-scatter.

        ``grad_full`` is a fresh tensor from autograd, not used elsewhere, so it is kept
        (and accumulated into) as it is. A unit used twice in one forward gets here twice;
        the two reductions are summed in :meth:`finish`.
        """
        grad_full = grad_full.reshape(-1).to(self.reduce_dtype)
        if self.stage == 1:
            if self._fresh_cycle:  # the last synchronised reduction was consumed
                self._carry = self.shard.grad.clone() if self.shard.grad is not None else None
                self._fresh_cycle, self._has_local = False, False
            if not self.require_sync or self._has_local:
                if self._has_local:
                    self.full_grad.add_(grad_full)
                else:
                    self.full_grad.copy_(grad_full)
                self._has_local = True
                if not self.require_sync:
                    return
                grad_full, self._has_local = self.full_grad, False
            self._launch(grad_full)
            return
        if self._unsynced is not None:
            grad_full, self._unsynced = self._unsynced.add_(grad_full), None
        if not self.require_sync:
            self._unsynced = grad_full
        else:
            self._launch(grad_full)
        self.release()  # stage 3: backward is done with this unit's weights

    def _launch(self, grad_full: torch.Tensor) -> None:
        if self.defer:
            self._deferred = grad_full if self._deferred is None else self._deferred.add_(grad_full)
        else:
            self.launch(grad_full)

    def take_unreduced(self) -> torch.Tensor | None:
        """``find_unused_parameters``, end of a synchronising backward: this rank's full gradient, or None.

        The deferred gradient, or one accumulated under ``no_sync`` that this backward
        did not reach (the unit ran in an earlier micro-step only).
        """
        if self._accumulated:  # stage 1 in place: the accumulation is in full_grad
            self.reduce_accumulated()
        elif self.stage == 1 and self._has_local:
            self._launch(self.full_grad)
            self._has_local = False
        elif self._unsynced is not None:
            self._launch(self._unsynced)
            self._unsynced = None
        grad, self._deferred = self._deferred, None
        return grad

    def launch(self, grad_full: torch.Tensor) -> None:
        """Start reducing ``grad_full``, a full-size gradient nothing else reads afterwards (it is consumed)."""
        # stage 1, fp32 throughout: a lone reduction lands straight in the gradient's home
        home = self.full_grad[self.lo:self.hi] if self._grad_is_view else None
        # a gradient from autograd is freed once reduced; stage 1's accumulation buffer lives on
        self.reduction.launch(grad_full, home, owned=grad_full is not self.full_grad)

    @property
    def reduced(self) -> bool:
        """Whether this synchronising backward gave the unit a reduction (launched or deferred)."""
        return bool(self.reduction.pending) or self._deferred is not None or self._accumulated

    def finish(self) -> None:
        """After backward: wait for the reductions and accumulate them into ``shard.grad``."""
        total = self.reduction.collect()
        if total is None:
            return
        if self._grad_is_view:  # stage 1, fp32 throughout: the gradient lives in full_grad
            view = self.full_grad[self.lo:self.hi]
            total = view if total.data_ptr() == view.data_ptr() else view.copy_(total)
        else:
            total = total.to(self.master_dtype)
        if self.stage == 1:
            if self._carry is not None:
                total.add_(self._carry)
            self._carry, self._fresh_cycle = None, True
            self.shard.grad = total
        elif self.shard.grad is None:
            self.shard.grad = total
        else:
            self.shard.grad.add_(total)
        self.stale = True  # an optimizer step is expected to follow
