"""``ZeRO``: data parallelism with sharded optimizer state, gradients and parameters (stages 1-3).

One strategy with a ``stage`` argument (Rajbhandari et al., SC 2020), built from
:class:`~dptrain.zero.unit.FlatUnit` s and dptrain's collectives:

- **stage 1**: each rank owns a contiguous 1/N of every flat unit and keeps optimizer
  state only for it. Backward accumulates full local gradients; the synchronising
  backward reduce-scatters them (the shard's slice is averaged over ranks), the
  optimizer steps the shard, and the next forward all-gathers the updated parameters.
- **stage 2**: as stage 1, but each unit is reduce-scattered as soon as backward has
  produced its gradient (overlapped with the rest of backward, like DDP's buckets) and
  only the shard of the gradient is kept.
- **stage 3**: parameters are sharded at rest too. Each *unit module* (instances of
  ``unit_classes``, e.g. a transformer block; or modules chosen by ``min_unit_numel``)
  is all-gathered just before its forward and freed after it (``reshard_after_forward``),
  gathered again when backward first needs its weights, and freed once its gradient
  is reduce-scattered. The next unit's all-gather is started while the current one
  computes (``prefetch``), in forward and in backward. Parameters outside every unit
  module form the *root unit*, gathered for the whole step.

Stages 1-2 group parameters into buckets exactly as the DDP engine does
(:func:`~dptrain.ddp.buckets.assign_buckets`, gradient-ready order, ``bucket_cap_mb``),
one flat unit per bucket.

The optimizer sees only shards: create it *after* wrapping, from ``model.parameters()``
(one flat 1-D Parameter per unit). Any ``torch.optim`` optimizer works, and its state
is then 1/N of the replicated state by construction.

How stage 3 frees the weights autograd saved for backward: ``saved.py``. Units some
ranks skip (``find_unused_parameters``): ``skipped.py``. Parameters read outside their
unit's forward: ``reads.py``. The optimizer check: ``replaced.py``.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dptrain import comm
from dptrain.comm.fingerprint import collective_check
from dptrain.comm.step_stats import StepCommStats
from dptrain.compress.zero import ShardedCompression
from dptrain.ddp.autograd import on_backward_reaching, queue_on_current_backward
from dptrain.ddp.replicas import broadcast_coalesced, tensor_signature, verify_replicas
from dptrain.zero.grouping import bucket_groups, collect_params, materialize_meta, module_groups
from dptrain.zero.hybrid import check_shard_size, hybrid_groups
from dptrain.zero.precision import MixedPrecision, cast_floats
from dptrain.zero.reads import gather_on_read
from dptrain.zero.replaced import mark_replaced
from dptrain.zero.saved import pack_weight, unpack_weight
from dptrain.zero.skipped import check_every_unit_reduced, reduce_in_order
from dptrain.zero.timing import ShardedStepComm
from dptrain.zero.unit import FlatUnit, ParamRef, ReductionQueue

__all__ = ["ZeRO"]


class ZeRO(nn.Module):
    """Wrap ``module`` for ZeRO stage 1, 2 or 3 over ``process_group``.

    ``algorithm`` / ``nodes``: the collectives' algorithm (:mod:`dptrain.comm`).
    ``unit_classes`` / ``min_unit_numel``: stage 3's unit modules. ``init_fn``: for a
    model built on the meta device, called on each module of a unit after its
    parameters are allocated (default: the module's ``reset_parameters``), one unit
    at a time, so the full model never exists on one rank. ``traffic``: a
    :class:`dptrain.comm.Traffic` counting the bytes this rank sends (dptrain's
    algorithms only, not ``native``). ``mixed_precision``: a
    :class:`~dptrain.zero.precision.MixedPrecision` (bf16 compute, fp32 master shards).
    ``split_by``: a function ``(name, parameter) -> key``; parameters with different
    keys never share a unit, and each shard's key is ``shard._zero_unit.key``, so an
    optimizer can give them different hyperparameters (the trainer splits matrices from
    vectors to decay only the former). ``compression``: a
    :class:`~dptrain.compress.zero.ShardedCompression` (fp16, bf16 or int8) that sends
    every gradient reduce-scatter compressed, on the same ranks as ``process_group``.
    ``check_collectives``: compare each unit's all-gather and reduce-scatter fingerprints
    across ranks through the job's store before calling them, on their first use
    (``"first"``, default), on every use (``"every"``), or not (``"off"``); see
    :mod:`dptrain.comm.fingerprint`. ``check_timeout_s``: how long a check waits for the
    other ranks before naming the missing ones.
    """

    def __init__(self, module: nn.Module, *, stage: int = 3, process_group: dist.ProcessGroup | None = None,
                 algorithm: str = "native", nodes=None, unit_classes: Sequence[type] = (),
                 min_unit_numel: int | None = None, reshard_after_forward: bool = True, prefetch: bool = True,
                 bucket_cap_mb: float = 4.0, init_fn: Callable[[nn.Module], None] | None = None,
                 device: torch.device | str | None = None, broadcast_buffers: bool = True,
                 traffic: comm.Traffic | None = None, mixed_precision: MixedPrecision | None = None,
                 split_by: Callable[[str, torch.Tensor], Hashable] | None = None,
                 compression: ShardedCompression | None = None, check_collectives: str = "first",
                 check_timeout_s: float = 300.0, find_unused_parameters: bool = False,
                 shard_size: int | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed initialised first: call "
                               "dist.init_process_group() (dptrain run and torchrun set up the environment)")
        if stage < 3 and (unit_classes or min_unit_numel):
            raise ValueError(f"unit_classes / min_unit_numel choose stage 3's unit modules; stage {stage} "
                             "shards buckets (bucket_cap_mb) instead")
        comm.check_algorithm(algorithm, nodes, dist.get_world_size(process_group))
        self.module = module
        self.stage, self.group, self.algorithm = stage, process_group, algorithm
        # hybrid sharding (zero/hybrid.py): units are sharded over shard_group and replicated across
        # replicate_group; without it both are plain ZeRO's (the whole group, no replicas)
        self.shard_group, self.replicate_group = process_group, None
        self.shard_size = shard_size or dist.get_world_size(process_group)
        hybrid = self.shard_size != dist.get_world_size(process_group)
        if hybrid:
            check_shard_size(self.shard_size, dist.get_world_size(process_group))
            if algorithm == "hierarchical" or compression is not None:
                raise ValueError("shard_size (hybrid sharding) is hierarchical by itself: use algorithm native, ring "
                                 "or tree, and no compression")
            nodes = None  # the subgroups' collectives stay within or across hosts: no node split inside them
        self.nodes = nodes
        self.find_unused_parameters = find_unused_parameters
        if find_unused_parameters:  # [Note: units some ranks skip] in skipped.py
            prefetch, reshard_after_forward = False, False
        self.prefetch, self.broadcast_buffers = prefetch, broadcast_buffers
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a dptrain.zero.MixedPrecision, got {mixed_precision!r}")
        self.mixed_precision = mixed_precision
        self._split_by = split_by
        self.world_size = dist.get_world_size(process_group)
        if compression is not None and not isinstance(compression, ShardedCompression):
            raise TypeError("compression must be a dptrain.compress.zero.ShardedCompression (fp16, bf16 or int8), "
                            f"got {compression!r}")
        if compression is not None and compression.world_size != self.world_size:
            raise ValueError(f"the compression's process group has {compression.world_size} ranks, ZeRO's has "
                             f"{self.world_size}: build ShardedCompression on the same group")
        if compression is not None and algorithm != "native":
            raise ValueError(f"algorithm {algorithm!r} chooses how uncompressed gradients are reduced; with "
                             "compression the codec's exchange does it: leave algorithm native")
        self.compression = compression
        check = collective_check(check_collectives, check_timeout_s, process_group)
        self.collective_check = check  # None when off or alone; shared by every unit
        self.device = torch.device(device) if device is not None else _default_device(module)
        refs, frozen = collect_params(module)
        # Verify first: ranks with different models could otherwise fail (or not) one by one below.
        self._verify(refs, tuple(unit_classes), min_unit_numel, bucket_cap_mb)
        if hybrid:
            self.shard_group, self.replicate_group = hybrid_groups(self.shard_size, process_group)
        if stage < 3:
            groups = bucket_groups(refs, bucket_cap_mb, self.device, self._key)
        else:
            groups = module_groups(module, refs, tuple(unit_classes), min_unit_numel, self._key)
        mp = mixed_precision or MixedPrecision(param_dtype=None)
        self.units: list[FlatUnit] = []
        for index, (owner, members) in enumerate(groups):
            key = self._key(members[0])  # before flattening: the key may read the parameter's shape
            full = self._flatten(members, init_fn)
            unit = FlatUnit(index, members, full, stage=stage, group=self.shard_group, algorithm=algorithm,
                            nodes=nodes, reshard_after_forward=reshard_after_forward and owner is not None,
                            traffic=traffic, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                            compression=compression, replicate_group=self.replicate_group)
            unit.owner = owner
            unit.key = key
            unit.check = check
            if find_unused_parameters:
                unit.defer, unit.single_piece = True, False
            self.units.append(unit)
        self._reductions = ReductionQueue(1)
        # the last synchronising backward's reductions (calls, bytes), and every collective's span and wait since
        # the step before (zero/timing.py)
        self.last_step_comm: StepCommStats = ShardedStepComm()
        self._step_comm = ShardedStepComm()
        for unit in self.units:
            unit.inflight = self._reductions
            unit.step_comm = self._step_comm
        self._shards = nn.ParameterList([u.shard for u in self.units])
        self._frozen = frozen
        self._buffers_to_sync = [b for b in module.buffers()]
        if self.world_size > 1 and (frozen or self._buffers_to_sync):
            broadcast_coalesced([p.detach() for p in frozen] + self._buffers_to_sync, 0, process_group)
        for unit in self.units:
            if unit.owner is not None:
                unit.owner.register_forward_pre_hook(self._make_pre_hook(unit))
                unit.owner.register_forward_hook(self._make_post_hook(unit))
        self._in_forward = False
        self._read_outside: list[FlatUnit] = []  # stage 3: units gathered for a read outside their forward
        if stage == 3:
            for unit in self.units:
                for ref in unit.refs:
                    for holder, attr in ref.holders:
                        gather_on_read(holder, attr, self, unit, ref.name)
        self._lazy: set[FlatUnit] = set()  # stages 1-2: units whose autograd views are not set yet
        if stage < 3:
            units_of: dict[nn.Module, list[FlatUnit]] = {}
            for unit in self.units:
                for ref in unit.refs:
                    for holder, _ in ref.holders:
                        if unit not in units_of.setdefault(holder, []):
                            units_of[holder].append(unit)
            for holder, units in units_of.items():
                holder.register_forward_pre_hook(self._make_first_use_hook(units))
        self._order: list[FlatUnit] = [u for u in self.units if u.owner is not None]
        self._owned = list(self._order)  # stage 3's unit modules in index order
        self._owned_at = {id(u): i for i, u in enumerate(self._owned)}
        self._gathered = 0               # find_unused_parameters: _owned[:_gathered] gathered this forward
        self._ran: list[FlatUnit] = []
        self._live: dict[int, FlatUnit] = {}
        self._finish_queued = False

    # ------------------------------------------------------------------ construction

    def _key(self, ref: ParamRef) -> Hashable:
        return self._split_by(ref.name, ref.tensor) if self._split_by is not None else None

    def _verify(self, refs: list[ParamRef], classes: tuple, min_numel: int | None, cap_mb: float) -> None:
        signature = tensor_signature([(r.name, r.tensor) for r in refs], "parameter")
        signature.append(("option", "zero", (self.stage, self.algorithm, [c.__name__ for c in classes], min_numel,
                                             cap_mb, repr(self.mixed_precision), self._compression_name(),
                                             self.shard_size),
                          repr(self.nodes), False))
        verify_replicas(signature, self.group, self.device)

    def _compression_name(self) -> str | None:
        c = self.compression
        return None if c is None else f"{type(c.codec).__name__}({c.codec.name}), feedback={c.feedback is not None}"

    def _flatten(self, members: list[ParamRef], init_fn) -> torch.Tensor:
        """The unit's full flat buffer on this device, identical on every rank (rank 0's values)."""
        if any(r.tensor.is_meta for r in members):
            materialize_meta(members, self.device, init_fn)
        with torch.no_grad():
            full = torch.cat([r.tensor.detach().reshape(-1).to(self.device) for r in members])
            if self.world_size > 1:
                dist.broadcast(full, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        for ref in members:
            for module, attr in ref.holders:
                del module._parameters[attr]
            mark_replaced(ref.tensor)  # an optimizer holding it raises (zero/replaced.py)
            ref.tensor.data = torch.empty(0, dtype=ref.tensor.dtype, device=ref.tensor.device)
        return full

    # ------------------------------------------------------------------ parameters

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The flat shards, one per unit: what the optimizer should get (frozen parameters stay in the module)."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for unit in self.units:
            yield f"{prefix}unit{unit.index}", unit.shard

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, by its original name (all ranks take part; for tests and export)."""
        out = {}
        for unit in self.units:
            full = torch.empty(unit.numel, dtype=unit.master_dtype, device=unit.device)
            comm.all_gather(full, unit.shard.detach(), algorithm=self.algorithm, group=self.shard_group,
                            nodes=self.nodes, validate=False)
            for ref, (a, b) in zip(unit.refs, unit.offsets()):
                out[ref.name] = full[a:b].view(ref.shape).clone()
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradient shards so that the norm of the *whole* gradient is at most ``max_norm``.

        The norm is over every rank's shard: each rank sums its shards' squares (in fp32)
        and one all-reduce adds them up (for ``norm_type=inf``, the maximum), so every
        rank gets the same norm and takes the same decision. A non-finite norm is returned
        as it is and nothing is scaled; skip the optimizer step then (all ranks will):

            norm = model.clip_grad_norm_(1.0)
            if torch.isfinite(norm):
                optimizer.step()

        Returns the norm before clipping, as torch's ``clip_grad_norm_`` does.
        """
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"norm_type must be 2.0 or inf for a sharded gradient norm, got {norm_type!r}")
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None and u.shard.grad.numel()]
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            g = g.detach().float()
            local = torch.maximum(local, g.abs().max()) if norm_type == math.inf else local + g.pow(2).sum()
        if self.shard_size > 1:  # the shard group's shards make the whole gradient (replicas hold the same)
            dist.all_reduce(local, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM,
                            group=self.shard_group)
        norm = local if norm_type == math.inf else local.sqrt()
        if math.isfinite(max_norm) and torch.isfinite(norm):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return norm

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, until the context exits."""
        for unit in self.units:
            unit.require_sync = False
        try:
            yield
        finally:
            for unit in self.units:
                unit.require_sync = True

    # ------------------------------------------------------------------ forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.world_size > 1 and self._buffers_to_sync:
            broadcast_coalesced(self._buffers_to_sync, 0, self.group)
        self._ran, self._gathered = [], 0
        for unit in self.units:
            if unit.owner is None:
                # Stages 1-2: plain views now, so that every attribute exists; autograd views
                # when a holder module first runs (see _make_first_use_hook).
                unit.materialize(differentiable=self.stage == 3)
        if self.stage < 3 and torch.is_grad_enabled():
            self._lazy = set(self.units)
        if self.stage == 3 and self.prefetch and self._order:
            self._order[0].gather(async_op=True)
        hooks = (torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if self.stage == 3
                 else contextlib.nullcontext())
        mp = self.mixed_precision
        if mp is not None and mp.cast_inputs:
            args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
        self._in_forward = True
        try:
            with hooks:
                out = self.module(*args, **kwargs)
        finally:
            self._in_forward = False
        if self.find_unused_parameters and self.stage == 3:
            self._gather_in_order(None)
        for unit in self._read_outside:
            self._live.pop(id(unit.full), None)
            unit.release()
        self._read_outside = []
        if mp is not None:
            out = cast_floats(out, mp.output_dtype)
        if self._ran:
            self._order = self._ran
        if torch.is_grad_enabled() and any(u.shard.requires_grad for u in self.units):
            if not on_backward_reaching(out, self._queue_finish):
                raise RuntimeError("ZeRO: the module's output has no autograd graph, so backward cannot "
                                   "reduce gradients; return the tensors the loss is computed from")
        elif self.stage == 3:
            self._release_all()
        return out

    def _make_pre_hook(self, unit: FlatUnit):
        def pre_hook(module, args):
            self._ran.append(unit)
            if self.find_unused_parameters:
                self._gather_in_order(unit)
            unit.materialize()
            if unit.reshard_after_forward:
                self._live[id(unit.full)] = unit
            if self.prefetch:
                following = self._next_in(self._order, unit, +1)
                if following is not None:
                    following.gather(async_op=True)
        return pre_hook

    def _make_first_use_hook(self, units: list[FlatUnit]):
        """Stages 1-2: give a unit its autograd views just before the first module holding it runs.

        Autograd runs ready nodes newest first. A unit's gradient is assembled by a node
        created where its views are made; made at the start of forward it is the oldest
        node of the graph and would run only when backward has nothing else left to do,
        so every unit's gradient would be held until then and no reduction would overlap
        backward. Made at first use, it runs right after the unit's last gradient is
        computed, as a DDP bucket's hook does.
        """
        def pre_hook(module, args):
            if not torch.is_grad_enabled():  # e.g. a checkpointed segment's first pass: it runs again in backward
                return
            for unit in units:
                if unit in self._lazy:
                    self._lazy.discard(unit)
                    unit.materialize()
        return pre_hook

    def _make_post_hook(self, unit: FlatUnit):
        def post_hook(module, args, output):
            if unit.reshard_after_forward:
                self._live.pop(id(unit.full), None)
                unit.release()
        return post_hook

    def read_outside_unit(self, unit: FlatUnit, module: nn.Module, attr: str, name: str) -> torch.Tensor:
        """Stage 3: ``module.attr`` (parameter ``name``) was read while its unit was not gathered (``reads.py``).

        Inside the forward the unit is gathered and kept until the end of forward;
        backward gathers it again through the saved-tensor hooks like any unit, and its
        gradient from both uses is summed. Outside the forward it is an error.
        """
        if not self._in_forward:
            raise AttributeError(
                f"ZeRO stage 3: parameter {name!r} ({type(module).__name__}.{attr}) is sharded across ranks "
                "outside the forward, so it cannot be read here. Read full parameters with "
                "model.gathered_state() (every rank must call it), or the shards with model.parameters()")
        unit.materialize()
        if unit.reshard_after_forward:
            self._live[id(unit.full)] = unit
            self._read_outside.append(unit)
        return module.__dict__[attr]

    def _gather_in_order(self, through: FlatUnit | None) -> None:
        """Stage 3, ``find_unused_parameters``: gather the unit modules up to ``through`` (None: all) in index order.

        Every rank then gathers every unit once per forward, in the same order, whichever
        units its forward runs ([Note: units some ranks skip] in skipped.py). A unit this rank skipped
        is dropped again at the end of forward.
        """
        owned = self._owned
        stop = len(owned) if through is None else self._owned_at[id(through)] + 1
        while self._gathered < stop:
            owned[self._gathered].gather()
            self._gathered += 1
        if through is None:
            ran = set(map(id, self._ran))
            for unit in owned:
                if id(unit) not in ran:
                    unit.release(force=True)

    @staticmethod
    def _next_in(order: list[FlatUnit], unit: FlatUnit, step: int) -> FlatUnit | None:
        try:
            i = order.index(unit) + step
        except ValueError:
            return None
        return order[i] if 0 <= i < len(order) else None

    def _pack(self, t: torch.Tensor) -> Any:
        return pack_weight(self._live, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        return unpack_weight(packed, self._prefetch_before)

    def _prefetch_before(self, unit: FlatUnit) -> None:
        """Backward regathered ``unit``: start gathering the one backward needs next (the one before it)."""
        earlier = self._next_in(self._order, unit, -1) if self.prefetch else None
        if earlier is not None:
            earlier.gather(async_op=True)

    # ------------------------------------------------------------------ backward

    def _queue_finish(self) -> None:
        if self._finish_queued:
            return
        self._finish_queued = True
        queue_on_current_backward(self._finish)

    def _finish(self) -> None:
        self._finish_queued = False
        syncing = self.units[0].require_sync
        if syncing:
            self._step_comm.backward_end = time.perf_counter()  # every gradient computed: what follows is waiting
        if syncing and self.find_unused_parameters:
            reduce_in_order(self.units, self.group, self._step_comm)
        elif syncing:
            check_every_unit_reduced(self.units, self.group)
            for unit in self.units:
                if unit.accumulates_in_place:
                    unit.reduce_accumulated()
        for unit in self.units:
            unit.finish()
        self._reductions.clear()
        if self._step_comm.calls:  # a synchronising backward (a no_sync one reduces nothing)
            self._step_comm.comm_end = time.perf_counter()
            self.last_step_comm, self._step_comm = self._step_comm, ShardedStepComm()
            for unit in self.units:
                unit.step_comm = self._step_comm
        if self.stage == 3:
            self._release_all()

    def _release_all(self) -> None:
        for unit in self.units:
            if unit._gathering is not None:
                unit.wait_gathered()
            self._live.pop(id(unit.full), None)
            unit.release(force=True)

    # ------------------------------------------------------------------ the wrapper protocol

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether backward reduce-scatters (read when backward ends); False accumulates locally, as ``no_sync``."""
        for unit in self.units:
            unit.require_sync = requires_gradient_sync

    def record_comm_spans(self, on: bool) -> None:
        """Nothing to switch: every collective's span is recorded already (zero/timing.py)."""

    def before_optimizer_step(self) -> None:
        """Nothing: the reduce-scatter in backward left each shard its averaged gradient."""


# --------------------------------------------------------------------- helpers


def _default_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
