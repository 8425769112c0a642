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
unit starts its reduce-scatter asynchronously, so it overlaps with the rest of
backward, and :meth:`FlatUnit.finish` collects it when backward is done.

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

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dptrain import comm
from dptrain.comm.step_stats import StepCommStats
from dptrain.zero.timing import start_timing

__all__ = ["ParamRef", "FlatUnit", "ReductionQueue"]


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
    def forward(ctx, shard: torch.Tensor, full: torch.Tensor, unit: "FlatUnit") -> torch.Tensor:
        ctx.unit = unit
        return full.view(full.shape)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.unit.reduce(grad_full)
        return None, None, None


class ReductionQueue:
    """The reduce-scatters in flight across a model's units, at most ``limit`` at a time.

    A reduction keeps its input, the unit's full-size gradient, alive until it is done.
    Without a bound every unit's full gradient would live until the end of backward:
    the whole unsharded gradient at once, which stage 3 exists to avoid. Before a unit
    launches, the oldest reductions are waited for and their inputs dropped, as torch's
    FSDP2 does (one in flight): a reduction still overlaps the backward of the next
    unit, the one whose gradient is being computed while it runs.
    """

    def __init__(self, limit: int = 1):
        if limit < 1:
            raise ValueError(f"at least one reduction must be allowed in flight, got {limit}")
        self.limit = limit
        self._units: collections.deque[FlatUnit] = collections.deque()

    def make_room(self) -> None:
        while len(self._units) >= self.limit:
            self._units.popleft().settle_oldest()

    def add(self, unit: "FlatUnit") -> None:
        self._units.append(unit)

    def clear(self) -> None:
        self._units.clear()


class FlatUnit:
    """Parameters flattened into one buffer, of which this rank owns the slice ``[lo, hi)``."""

    def __init__(self, index: int, refs: list[ParamRef], full: torch.Tensor, *, stage: int,
                 group: dist.ProcessGroup | None, algorithm: str, nodes, reshard_after_forward: bool,
                 traffic: comm.Traffic | None = None, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, compression=None,
                 replicate_group: dist.ProcessGroup | None = None):
        self.index, self.refs, self.stage = index, refs, stage
        # hybrid sharding (zero/hybrid.py): ``group`` is the shard group; each reduced shard is then
        # averaged over the replicate group, the ranks holding the same shard
        self.replicate_group = replicate_group
        self._replicate_comm = dict(algorithm=algorithm, group=replicate_group, validate=False, traffic=traffic)
        self.compression = compression  # a dptrain.compress.zero.ShardedCompression, or None
        self.check = None  # a dptrain.comm.fingerprint.CollectiveCheck, set by ZeRO
        self.group, self.algorithm, self.nodes = group, algorithm, nodes
        self._comm = dict(algorithm=algorithm, group=group, nodes=nodes, validate=False, traffic=traffic)
        self.numel = full.numel()
        # master: the shard the optimizer steps; compute: the full buffer and its
        # gradient; reduce: the reduce-scatter (see zero/precision.py)
        self.master_dtype = full.dtype
        self.compute_dtype = param_dtype or full.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.device = full.device
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.lo, self.hi = comm.shard_range(self.numel, self.world_size, self.rank)
        self.reshard_after_forward = reshard_after_forward and stage == 3
        self.full: torch.Tensor | None
        if stage < 3 and self.compute_dtype == self.master_dtype:
            self.full = full
            self.shard = nn.Parameter(full[self.lo:self.hi])  # shares the full buffer's storage
        else:
            self.shard = nn.Parameter(full[self.lo:self.hi].clone())
            self.full = full.to(self.compute_dtype) if stage < 3 else None
        self.shard._zero_unit = self  # lets LARS/LAMB and checkpoints find the layout
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
        self._waiting = self._pieces = self._forwards = 0
        self.single_piece: bool | None = None
        self.stale = False  # the shard changed since the full buffer was gathered
        self._gathering: comm.Work | None = None
        self._pending: list[tuple[comm.Work | None, torch.Tensor, torch.Tensor | None]] = []
        # hybrid sharding: this backward's reductions still to come (one per differentiable use in a synced
        # forward), and the reduced pieces held to be averaged over the replicas once, summed, in finish
        self._pieces_due = 0
        self._held: list[torch.Tensor] = []
        self.inflight: ReductionQueue | None = None  # shared by a model's units (set by ZeRO)
        self._unsynced: torch.Tensor | None = None  # stages 2-3: local gradients under no_sync
        self._fresh_cycle, self._has_local = True, False  # stage 1: the local accumulation's state
        self._carry: torch.Tensor | None = None
        self.require_sync = True
        # find_unused_parameters: reductions wait for the end of backward, where every rank issues one per
        # unit in index order (skipped.reduce_in_order); this holds the gradient until then
        self.defer = False
        self._deferred: torch.Tensor | None = None
        # this step's counts and collective spans (set by ZeRO, which publishes them as last_step_comm), and what one
        # reduction of this unit sends as the collective is issued (comm.sent_bytes)
        self.step_comm: StepCommStats | None = None
        self._sent_bytes = comm.sent_bytes("reduce_scatter", self.numel, self.reduce_dtype.itemsize,
                                           algorithm=algorithm, group=group, nodes=nodes, device=self.device,
                                           consume_input=True)
        if replicate_group is not None:
            self._sent_bytes += comm.sent_bytes("all_reduce", self.hi - self.lo, self.reduce_dtype.itemsize,
                                                algorithm=algorithm, group=replicate_group, device=self.device)

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
            if self.check is not None:  # the full buffer only: shards differ by one element where numel is uneven
                self.check.verify_site(("gather", self.index), "all_gather", [self.full], f"unit {self.index}")
            work = comm.all_gather(self.full, source, async_op=True, **self._comm)
        work = start_timing(work, self.step_comm, "all-gather", self.index, self.full)
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
            if self.replicate_group is not None and self.require_sync:
                self._pieces_due += 1
        else:
            out = full.view(full.shape)
        parts = out.split([r.numel for r in self.refs])
        if differentiable and self.inflight is not None:
            # Just before autograd concatenates the unit's gradients into a new full-size
            # tensor, let the previous reduction finish and drop its input (FSDP2 waits
            # for the previous reduce-scatter at the same point): one full-size gradient
            # fewer at the peak, and the previous reduction still overlapped this unit's
            # backward.
            parts[0].grad_fn.register_prehook(self._before_concat)
        for ref, view in zip(self.refs, parts):
            view = view.view(ref.shape)
            for module, attr in ref.holders:
                setattr(module, attr, view)
        return out

    def _before_concat(self, grad_outputs):
        self.inflight.make_room()

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
        for ref, view, grad in zip(self.refs, full.split(sizes), self.full_grad.split(sizes)):
            leaf = view.view(ref.shape).detach().requires_grad_(True)
            leaf.grad = grad.view(ref.shape)
            leaf.register_post_accumulate_grad_hook(self._arrived)
            for module, attr in ref.holders:
                setattr(module, attr, leaf)
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
                if attr in module.__dict__:
                    delattr(module, attr)
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
        """Start reducing ``grad_full``, a full-size gradient nothing else reads afterwards.

        It is consumed: the collective works in it rather than in a copy (on gloo, whose
        reduce-scatter is an all-reduce of a copy, it is all-reduced in place), so a
        reduction in flight holds one full-size buffer, not two.
        """
        if self.inflight is not None:  # bound the full-size gradients alive at once (see ReductionQueue)
            self.inflight.make_room()
        self._pieces_due = max(0, self._pieces_due - 1)
        if self._grad_is_view and not self._pending:
            out = self.full_grad[self.lo:self.hi]  # stage 1: reduce straight into the gradient's home
        else:
            out = torch.empty(self.hi - self.lo, dtype=self.reduce_dtype, device=self.device)
        if self.check is not None:
            op = "reduce_scatter" if self.compression is None else f"{self.compression.codec.name} reduce_scatter"
            op += f" into {str(out.dtype).removeprefix('torch.')}"  # of the full gradient; shards may differ by one
            self.check.verify_site(("reduce", self.index), op, [grad_full], f"unit {self.index}")
        if self.step_comm is not None:
            self.step_comm.calls += 1
            self.step_comm.bytes += grad_full.numel() * grad_full.element_size()
        if self.compression is not None:  # encoded now; the exchange runs on the compression's own thread
            work = self.compression.reduce_scatter(self.index, out, grad_full)  # counts the bytes it sends
        else:
            if self.step_comm is not None:
                self.step_comm.sent_bytes += self._sent_bytes
            work = comm.reduce_scatter(out, grad_full, "avg", async_op=True, consume_input=True, **self._comm)
        work = start_timing(work, self.step_comm, "reduce-scatter", self.index, grad_full)
        self._pending.append((work, out, grad_full))  # the input stays alive until the reduction is done
        if self.inflight is not None:
            self.inflight.add(self)

    def settle_oldest(self) -> None:
        """Wait for this unit's oldest unfinished reduce-scatter and drop its full-size input.

        With hybrid sharding the shard's all-reduce over the replicate group starts here.
        """
        for i, (_, _, grad_full) in enumerate(self._pending):
            if grad_full is not None:
                self._settle(i)
                return

    def _settle(self, i: int) -> None:
        work, out, _ = self._pending[i]
        work.wait()
        if self.replicate_group is not None and (self._pieces_due or len(self._pending) > 1):
            self._held.append(out)  # a unit used twice (a tied weight): its pieces cross hosts once, summed
            self._pending[i] = (None, out, None)
        else:
            self._pending[i] = (self._replicate(out), out, None)

    def _replicate(self, out: torch.Tensor) -> comm.Work | None:
        """Hybrid sharding: start averaging the reduced shard ``out`` over the replicate group."""
        if self.replicate_group is None:
            return None
        work = comm.all_reduce(out, "avg", async_op=True, **self._replicate_comm)
        return start_timing(work, self.step_comm, "all-reduce over replicas", self.index, out)

    @property
    def reduced(self) -> bool:
        """Whether this synchronising backward gave the unit a reduction (launched or deferred)."""
        return bool(self._pending) or self._deferred is not None or self._accumulated

    def finish(self) -> None:
        """After backward: wait for the reductions and accumulate them into ``shard.grad``."""
        self._pieces_due = 0
        if not self._pending:
            return
        for i, (_, _, grad_full) in enumerate(self._pending):  # every reduce-scatter done, replicas' started
            if grad_full is not None:
                self._settle(i)
        outs = []
        for work, out, _ in self._pending:
            if work is not None:
                work.wait()
            if not any(out is held for held in self._held):
                outs.append(out)
        if self._held:  # one all-reduce over the replicas for the held pieces
            held = self._held[0]
            for piece in self._held[1:]:
                held.add_(piece)
            self._replicate(held).wait()
            outs.append(held)
            self._held = []
        self._pending.clear()
        total = outs[0]
        for out in outs[1:]:
            total.add_(out)
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
