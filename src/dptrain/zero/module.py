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

The optimizer sees only shards: create it *after* wrapping, from ``model.parameters()``
(one flat 1-D Parameter per unit). Any ``torch.optim`` optimizer works, and its state
is then 1/N of the replicated state by construction.

Building the units (stages 1-2: the DDP engine's buckets): ``build.py``; their
reductions: ``reduction.py``. How stage 3 frees the weights autograd saved for backward:
``saved.py``. Units some ranks skip: ``skipped.py``. Parameters read outside their
unit's forward: ``reads.py``. The optimizer check: ``replaced.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.comm.average import broadcast_buffers_
from dptrain.comm.fingerprint import collective_check
from dptrain.comm.step_stats import StepCommStats
from dptrain.ddp.autograd import on_backward_reaching, queue_on_current_backward
from dptrain.ddp.replicas import broadcast_coalesced
from dptrain.zero.build import build_units, check_policies, default_device, verify_same_model
from dptrain.zero.grouping import collect_params
from dptrain.zero.hybrid import ShardGroups, hybrid_groups
from dptrain.zero.norm import clip_sharded_grad_norm_
from dptrain.zero.policy import (
    CheckPolicy,
    CommPolicy,
    InitPolicy,
    ShardingPolicy,
    UnitPolicy,
    ZeROPolicies,
    resolve_policies,
)
from dptrain.zero.precision import MixedPrecision, cast_floats
from dptrain.zero.reads import gather_on_read
from dptrain.zero.reduction import CommContext, ReductionQueue
from dptrain.zero.saved import pack_weight, unpack_weight
from dptrain.zero.skipped import check_every_unit_reduced, reduce_in_order
from dptrain.zero.state import ShardedState
from dptrain.zero.timing import ShardedStepComm
from dptrain.zero.unit import FlatUnit
from dptrain.zero.visible import StateDictGuard, parameter_names

__all__ = ["ZeRO"]


class ZeRO(ShardedState, nn.Module):
    """Wrap ``module`` for ZeRO stage 1, 2 or 3 over ``process_group``.

    The options come as small frozen policies, one per concern, as FSDP2 takes its
    ``MixedPrecisionPolicy`` (``zero/policy.py``): ``units`` (:class:`UnitPolicy`: stage
    3's unit modules, stages 1-2's bucket size, ``split_by``), ``sharding``
    (:class:`ShardingPolicy`: hybrid ``shard_size``, ``reshard_after_forward``,
    ``prefetch``, ``find_unused_parameters``), ``communication`` (:class:`CommPolicy`:
    algorithm, nodes, traffic, compression, ``broadcast_buffers``), ``checks``
    (:class:`CheckPolicy`: collectives compared across ranks), ``init``
    (:class:`InitPolicy`: meta-device construction) and ``mixed_precision``
    (:class:`~dptrain.zero.precision.MixedPrecision`: bf16 compute, fp32 master shards).

    Every field is also a keyword argument of its own, as ZeRO took them before the
    policies (``prefetch=False``, ``check_collectives="every"``: ``policy.KEYWORDS``);
    one given beside its policy replaces that field. A shard's ``split_by`` key is
    ``shard._zero_unit.key``, for optimizer groups (the trainer decays matrices only).
    """

    def __init__(self, module: nn.Module, *, stage: int = 3, process_group: dist.ProcessGroup | None = None,
                 units: UnitPolicy | None = None, sharding: ShardingPolicy | None = None,
                 communication: CommPolicy | None = None, checks: CheckPolicy | None = None,
                 init: InitPolicy | None = None, mixed_precision: MixedPrecision | None = None, **keywords: Any):
        super().__init__()
        policies = resolve_policies(dict(units=units, sharding=sharding, communication=communication, checks=checks,
                                         init=init, mixed_precision=mixed_precision), keywords)
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed initialised first: call "
                               "dist.init_process_group() (dptrain run and torchrun set up the environment)")
        self.world_size = dist.get_world_size(process_group)
        check_policies(stage, policies, self.world_size)
        self.shard_size = policies.sharding.shard_size or self.world_size
        if self.shard_size != self.world_size:  # the subgroups' collectives stay within or across hosts: no node split
            policies = replace(policies, communication=replace(policies.communication, nodes=None))
        self.module, self.stage, self.group, self.policies = module, stage, process_group, policies
        self._expose(policies)
        self.device = torch.device(policies.init.device) if policies.init.device is not None \
            else default_device(module)
        refs, self._frozen = collect_params(module)
        # Verify first: ranks with different models could otherwise fail (or not) one by one below.
        verify_same_model(refs, stage, policies, self.shard_size, process_group, self.device)
        # hybrid sharding (zero/hybrid.py): units are sharded over the shard group and replicated across the
        # replicate group; without it the shard group is the whole group and there are no replicas
        groups = hybrid_groups(self.shard_size, process_group) if self.shard_size != self.world_size else \
            ShardGroups(process_group)
        self.shard_group, self.replicate_group = groups.shard, groups.replicate
        # the last synchronising backward's reductions (calls, bytes), and every collective's span and wait since
        # the step before (zero/timing.py)
        self.last_step_comm: StepCommStats = ShardedStepComm()
        self._context = CommContext(ReductionQueue(1), self.collective_check, ShardedStepComm())
        self.units: list[FlatUnit] = build_units(module, refs, stage=stage, policies=policies, groups=groups,
                                                 context=self._context, device=self.device, group=process_group)
        self._shards = nn.ParameterList([u.shard for u in self.units])
        self._guard = StateDictGuard(module)  # its parameters are placeholders now (visible.py)
        self.parameter_names = parameter_names(module, [r for u in self.units for r in u.refs])  # tied: several
        self._sharded_names = {alias: first for first, names in self.parameter_names.items() for alias in names}
        for unit in self.units if stage < 3 else []:  # module.weight reads the full buffer between steps
            unit.materialize(differentiable=False)
        self._sync_buffers_once(module)
        self._install_hooks()
        self._init_forward_state()

    def _expose(self, policies: ZeROPolicies) -> None:
        """The policies' fields the wrapper and its readers (planner, trainer, checkpoints) consult directly."""
        c, s = policies.communication, policies.sharding
        self.algorithm, self.nodes, self.compression = c.algorithm, c.nodes, c.compression
        self.broadcast_buffers, self.mixed_precision = c.broadcast_buffers, policies.mixed_precision
        self.find_unused_parameters = s.find_unused_parameters
        self.prefetch = s.prefetches  # [Note: units some ranks skip] in skipped.py: off with find_unused_parameters
        # None when off or alone; shared by every unit
        self.collective_check = collective_check(policies.checks.collectives, policies.checks.timeout_s, self.group)

    def _sync_buffers_once(self, module: nn.Module) -> None:
        """Rank 0's frozen parameters and buffers to every rank (buffers again before each forward if asked)."""
        self._buffers_to_sync = list(module.buffers())
        if self.world_size > 1 and (self._frozen or self._buffers_to_sync):
            broadcast_coalesced([p.detach() for p in self._frozen] + self._buffers_to_sync, 0, self.group)

    def _install_hooks(self) -> None:
        """Stage 3: gather/release around each unit module, gather on a read outside it; stages 1-2: first use."""
        for unit in self.units:
            if unit.owner is not None:
                unit.owner.register_forward_pre_hook(self._make_pre_hook(unit))
                unit.owner.register_forward_hook(self._make_post_hook(unit))
        if self.stage == 3:
            for unit in self.units:
                for ref in unit.refs:
                    for holder, attr in ref.holders:
                        gather_on_read(holder, attr, self, unit, ref.name)
            return
        units_of: dict[nn.Module, list[FlatUnit]] = {}
        for unit in self.units:
            for ref in unit.refs:
                for holder, _ in ref.holders:
                    if unit not in units_of.setdefault(holder, []):
                        units_of[holder].append(unit)
        for holder, units in units_of.items():
            holder.register_forward_pre_hook(self._make_first_use_hook(units))

    def _init_forward_state(self) -> None:
        self._in_forward = False
        self._read_outside: list[FlatUnit] = []  # stage 3: units gathered for a read outside their forward
        self._lazy: set[FlatUnit] = set()  # stages 1-2: units whose autograd views are not set yet
        self._order: list[FlatUnit] = [u for u in self.units if u.owner is not None]
        self._owned = list(self._order)  # stage 3's unit modules in index order
        self._owned_at = {id(u): i for i, u in enumerate(self._owned)}
        self._gathered = 0               # find_unused_parameters: _owned[:_gathered] gathered this forward
        self._ran: list[FlatUnit] = []
        self._live: dict[int, FlatUnit] = {}
        self._finish_queued = False

    # ------------------------------------------------------------------ parameters

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The flat shards, one per unit: what the optimizer should get (frozen parameters stay in the module)."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for unit in self.units:
            yield f"{prefix}unit{unit.index}", unit.shard

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradient shards so that the norm of the *whole* gradient is at most ``max_norm``.

        The norm is over every rank's shard (``zero/norm.py``), so every rank gets the
        same norm and takes the same decision. A non-finite norm is returned as it is and
        nothing is scaled; skip the optimizer step then (all ranks will):

            norm = model.clip_grad_norm_(1.0)
            if torch.isfinite(norm):
                optimizer.step()

        Returns the norm before clipping, as torch's ``clip_grad_norm_`` does.
        """
        return clip_sharded_grad_norm_([u.shard for u in self.units], max_norm, norm_type, self.shard_group,
                                       self.device)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, until the context exits."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.world_size > 1 and self._buffers_to_sync:
            broadcast_coalesced(self._buffers_to_sync, 0, self.group)
        self._ran, self._gathered = [], 0
        outside = [unit for unit in self.units if unit.owner is None]
        for unit in outside:  # every all-gather in flight before the first is waited for, not one at a time
            unit.gather(async_op=True)
        for unit in outside:
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
        gradient from both uses is summed. Outside the forward the read gets the parameter's
        placeholder (``visible.py``), as ``module.parameters()`` does: torch's state-dict helpers
        walk the module by name; the values are ``full_state_dict()``'s.
        """
        if not self._in_forward:
            return module._parameters[attr]
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
        step_comm = self._context.step_comm
        if syncing:
            step_comm.backward_end = time.perf_counter()  # every gradient computed: what follows is waiting
        if syncing and self.find_unused_parameters:
            reduce_in_order(self.units, self.group, step_comm)
        elif syncing:
            check_every_unit_reduced(self.units, self.group)
            for unit in self.units:
                if unit.accumulates_in_place:
                    unit.reduce_accumulated()
        for unit in self.units:
            unit.finish()
        self._context.reductions.clear()
        if step_comm.calls:  # a synchronising backward (a no_sync one reduces nothing)
            step_comm.comm_end = time.perf_counter()
            self.last_step_comm, self._context.step_comm = step_comm, ShardedStepComm()
        if self.stage == 3:
            self._release_all()

    def _release_all(self) -> None:
        for unit in self.units:
            if unit._gathering is not None:
                unit.wait_gathered()
            self._live.pop(id(unit.full), None)
            unit.release(force=True)

    def __getstate__(self) -> dict[str, Any]:
        """Refused, as FSDP2 refuses: a shard means nothing without its process group, and a whole copy is 1/N of one."""
        raise TypeError(
            "cannot pickle or deepcopy dptrain's ZeRO: each rank holds only its shard of every flat unit, tied to the "
            "process group that sharded it. Save the model with dptrain.zero.checkpoint (sharded, resharding on load) "
            "or its full state_dict (gathered_state() on every rank), or copy model.module before wrapping, then wrap "
            "the copy in ZeRO again")

    # ------------------------------------------------------------------ the wrapper protocol

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether backward reduce-scatters (read when backward ends); False accumulates locally, as ``no_sync``."""
        for unit in self.units:
            unit.require_sync = requires_gradient_sync

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Average each reduced shard over its replicas by ``hook(state, shard)`` rather than a fixed replicate group.

        Hybrid sharding where the replicas change from step to step (live recovery: a round's
        members; torchft's fault-tolerant HSDP puts the same all-reduce behind its manager):
        after a unit's reduce-scatter over the shard group, ``hook`` is called with the reduced
        shard (``shard.buffer()``, the DDP engine's bucket protocol) and returns a handle whose
        ``wait()`` leaves it averaged over the replicas. The model must shard over its whole group
        (no ``shard_size`` below it): the hook is then the only replica dimension.
        """
        if self.replicate_group is not None:
            raise ValueError(f"this model already replicates over a fixed group (shard_size={self.shard_size} of "
                             f"{self.world_size} ranks): a comm hook replaces that group, so build it over the shard "
                             "group alone (shard_size = its world size)")
        for unit in self.units:
            unit.reduction.replicate_hook = (state, hook)

    def record_comm_spans(self, on: bool) -> None:
        """Nothing to switch: every collective's span is recorded already (zero/timing.py)."""

    def before_optimizer_step(self) -> None:
        """Nothing: the reduce-scatter in backward left each shard its averaged gradient."""

    def after_optimizer_step(self) -> None:
        """Nothing: the next forward gathers the stepped shards."""

    def step_metrics(self) -> dict[str, float]:
        return {}  # its collectives' statistics are last_step_comm's

    def finish(self) -> None:
        """Collective: rank 0's buffers on every rank, as the DDP engine's ``finish``; the shards never differ."""
        if self.broadcast_buffers:
            broadcast_buffers_(self.module, self.group)

    def evaluating(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The wrapper itself: its forward gathers each unit (and, without gradients, frees it again)."""
        return contextlib.nullcontext(self)
