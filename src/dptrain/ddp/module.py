"""dptrain's ``DistributedDataParallel``: a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

Data parallelism replicates the model on every rank, feeds each rank a different shard
of the global batch, and averages gradients with an all-reduce so that every replica
takes the same optimizer step. The wrapper below

- checks at construction that every rank wrapped the same model, and broadcasts rank
  0's parameters and buffers so the replicas start identical;
- re-broadcasts buffers (BatchNorm running statistics) before a forward, following
  torch's rule: once per synchronised step, not inside ``no_sync``;
- hands gradients to a :class:`~dptrain.ddp.reducer.Reducer`, which all-reduces them in
  buckets while backward is still running (the communication/computation overlap);
- supports ``no_sync()`` for gradient accumulation, unused parameters, activation
  checkpointing (reentrant and not), communication hooks, and uneven inputs through
  torch's ``Join`` context manager (it is a ``Joinable``).

On CUDA with NCCL, each bucket's all-reduce runs on NCCL's own stream, ordered after
the gradient copy on the compute stream and waited for by the compute stream at the
end of backward, so no host synchronisation is added. On CPU it runs on gloo's
background threads.

A torch DDP script works unchanged with ``from dptrain import DistributedDataParallel``, and code that
asks ``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` gets True: the class is a subclass of
torch's that never builds torch's reducer ([Note: a subclass of torch's DDP that never runs torch's __init__]
in ``torch_class.py``). Parameters and buffers named in torch's ignore list
(``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``) are neither broadcast nor reduced.
Under ``torch.compile`` the compiled graph is split at bucket boundaries, so the all-reduces still overlap
backward ([Note: compiled graphs split at bucket boundaries] in ``compiled.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from dptrain.comm import check_algorithm
from dptrain.comm.average import broadcast_buffers_
from dptrain.comm.fingerprint import collective_check
from dptrain.ddp.autograd import on_backward_reaching
from dptrain.ddp.buckets import DEFAULT_BUCKET_CAP_MB, ParamInfo, ddp_bucket_layout
from dptrain.ddp.comm_hooks import CommHook
from dptrain.ddp.compiled import TorchDDP, eager, run_module, skip_frame, split_bytes
from dptrain.ddp.errors import NothingToTrainError
from dptrain.ddp.join import DDPJoinHook
from dptrain.ddp.optimizer_in_backward import BucketOptimizer
from dptrain.ddp.pickling import pickled_state, restore
from dptrain.ddp.reducer import Reducer, StepCommStats
from dptrain.ddp.replicas import broadcast_coalesced, tensor_signature, verify_replicas
from dptrain.ddp.sync_switch import GradSyncSwitch
from dptrain.ddp.torch_class import check_arguments, refusal, refuse_the_rest
from dptrain.utils.tensors import iter_tensors, map_tensors

__all__ = ["DistributedDataParallel"]


@refuse_the_rest
class DistributedDataParallel(GradSyncSwitch, TorchDDP, Joinable):
    """Data-parallel wrapper with bucketed all-reduce overlapped with backward.

    A subclass of ``torch.nn.parallel.DistributedDataParallel`` that never runs torch's ``__init__``
    (``torch_class.py``): ``isinstance`` checks and torch's checkpoint helpers treat it as torch's.

    Arguments follow ``torch.nn.parallel.DistributedDataParallel``:

    - ``module``: the model, already on its device. All parameters must be on one device.
    - ``device_ids``: ``None`` for CPU modules, or ``[device]`` for a single-device module;
      inputs are moved there before the forward. ``output_device`` and ``dim`` are
      accepted for compatibility (they matter only for multi-device modules, which
      torch itself has deprecated).
    - ``broadcast_buffers``: re-broadcast rank 0's buffers before forwards (default True);
      ``False`` also leaves each rank's buffers as they are at construction, as in torch.
    - ``init_sync``: broadcast rank 0's parameters (and buffers, see above) at construction.
    - ``process_group``: the data-parallel group; default the world group.
    - ``bucket_cap_mb``: bucket size in MiB. ``None`` means 25 MiB with a 1 MiB first
      bucket (torch's default); an explicit value applies to every bucket.
    - ``last_bucket_cap_mb`` (dptrain's): the gradients ready last (the first layers') get a bucket of
      about this size of their own, the mirror of the small first bucket: the all-reduce started when
      backward ends, which nothing overlaps, carries little. ``None`` (default): torch's layout.
    - ``find_unused_parameters``: allow parameters to get no gradient in a step (walks
      the autograd graph after each forward to find them early).
    - ``gradient_as_bucket_view``: make ``.grad`` views into the flat buckets, saving the
      copy in and out and one gradient-sized buffer of memory.
    - ``static_graph``: the set of used parameters never changes; learned on the first
      step, then no graph walk is needed.
    - torch's ignore list: parameters and buffers named in ``module._ddp_params_and_buffers_to_ignore``
      (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)``) are
      neither broadcast nor reduced (``parameters_to_ignore``).

    dptrain's own arguments:

    - ``algorithm``: how buckets are all-reduced, one of :data:`dptrain.comm.ALGORITHMS`:
      ``"native"`` (the backend's all-reduce, default), or dptrain's ``"ring"``,
      ``"tree"``, ``"naive"`` or ``"hierarchical"`` (see :mod:`dptrain.comm`). Each
      bucket is launched asynchronously through it, so overlap with backward is kept.
      A registered communication hook replaces it (a hook may call
      ``dptrain.comm.all_reduce(..., algorithm=...)`` itself).
    - ``nodes``: for ``"hierarchical"``, ranks per node (the local world size) or an
      explicit grouping of group ranks.
    - ``traffic``: a :class:`dptrain.comm.Traffic` that counts the bytes this rank's
      bucket reductions send (dptrain's algorithms only; the backend does not report).
    - ``check_collectives``: compare each bucket reduction's fingerprint (op, dtype, shape,
      comm hook) across ranks through the job's store before calling it
      (:mod:`dptrain.comm.fingerprint`): ``"first"`` (default) on each bucket's first
      reduction, ``"every"`` on all of them, ``"off"``. A mismatch is a
      ``CollectiveMismatchError`` on every rank instead of gloo's SIGABRT; a rank that does
      not arrive within ``check_timeout_s`` is named in a ``CollectiveTimeoutError``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        algorithm: str = "native",
        nodes: int | Sequence[Sequence[int]] | None = None,
        traffic: Any = None,
        check_collectives: str = "first",
        check_timeout_s: float = 300.0,
        forward_sync_buffers: bool | None = None,
        last_bucket_cap_mb: float | None = None,
        **unsupported: Any,
    ):
        # nn.Module's __init__, not torch's DDP's: that one would build torch's C++ reducer (torch_class.py)
        nn.Module.__init__(self)
        Joinable.__init__(self)
        check_arguments(unsupported, bucket_cap_mb, device_ids)
        if last_bucket_cap_mb is not None and not last_bucket_cap_mb > 0:
            raise ValueError(f"last_bucket_cap_mb must be > 0, got {last_bucket_cap_mb}; use None for no "
                             "separate last bucket")
        check = collective_check(check_collectives, check_timeout_s, process_group)  # validates the mode first
        self.collective_check = check  # None when off or alone
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        check_algorithm(algorithm, nodes, dist.get_world_size(self.process_group))
        self.algorithm, self.nodes = algorithm, nodes
        # kept to rebuild the reducer when a pickled or deep-copied model is loaded (pickling.py)
        self.bucket_cap_mb, self.last_bucket_cap_mb, self.traffic = bucket_cap_mb, last_bucket_cap_mb, traffic
        self.bucket_bytes_cap = split_bytes(bucket_cap_mb, DEFAULT_BUCKET_CAP_MB)  # read by dynamo (compiled.py)
        self.check_collectives, self.check_timeout_s = check_collectives, check_timeout_s
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device
        self.dim = dim
        # torch 2.13's new name for broadcast_buffers (torch's property, inherited, aliases it); given, it wins
        self.forward_sync_buffers = broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._comm_hook_registered = False
        self._forward_calls = 0

        # torch's ignore list: names set on the bare module by torch's static helper, read once here as torch does
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = self._reducer_parameters()
        # the buffers to broadcast each forward, listed once as torch's DDP does (a buffer reassigned to a new
        # tensor after wrapping is not followed): walking every submodule costs 0.5 ms a forward on 400 modules
        self._synced_buffers = self._managed("buffers")
        self.device = _module_device(module)
        self._check_replicas(named, [("option", "algorithm", algorithm, repr(nodes), False)])
        self._param_names = [name for name, _ in named]
        if init_sync:  # every parameter not ignored, frozen ones too, and the buffers unless broadcast_buffers=False
            # torch 2.13's rule: broadcast_buffers=False keeps rank-local buffers at construction too; the new
            # name forward_sync_buffers, given, syncs them at construction whatever its value
            init_buffers = forward_sync_buffers is not None or broadcast_buffers
            states = self._managed("parameters") + (self._synced_buffers if init_buffers else [])
            broadcast_coalesced(states, 0, self.process_group)
        self.reducer = self._build_reducer(named, check)

    def _managed(self, kind: str) -> list[torch.Tensor]:
        """The module's parameters or buffers (``kind``) that DDP keeps equal across ranks: all but torch's ignore
        list."""
        named = self.module.named_parameters() if kind == "parameters" else self.module.named_buffers()
        return [t for name, t in named if name not in self.parameters_to_ignore]

    def _reducer_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """What the reducer averages: the trainable parameters not in torch's ignore list (also after unpickling)."""
        return _trainable_parameters(self.module, self.parameters_to_ignore)

    def _build_reducer(self, named: list[tuple[str, nn.Parameter]], check: Any) -> Reducer:
        params = [p for _, p in named]
        return Reducer(
            params, [name for name, _ in named],
            ddp_bucket_layout([ParamInfo.of(p) for p in params], self.bucket_cap_mb, self.last_bucket_cap_mb),
            self.process_group,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            algorithm=self.algorithm,
            nodes=self.nodes,
            traffic=self.traffic,
            check=check,
        )

    # ---------------------------------------------------------- pickling, deepcopy

    def __getstate__(self) -> dict[str, Any]:
        """The state without the process group, reducer and collective check (torch's rule; see pickling.py)."""
        return pickled_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild on the default process group with the same options: a fresh reducer, no comm hook."""
        restore(self, state)

    def _check_replicas(self, named: list[tuple[str, nn.Parameter]], options: list[tuple]) -> None:
        # Collective first: a rank whose model differs must fail together with the rest. Ignored parameters and
        # buffers may differ between ranks, as with torch's class.
        ignored = self.parameters_to_ignore
        signature = options + tensor_signature(
            ((n, p) for n, p in self.module.named_parameters() if n not in ignored), "parameter")
        signature += tensor_signature(((n, b) for n, b in self.module.named_buffers() if n not in ignored), "buffer")
        verify_replicas(signature, self.process_group, self.device)
        if not named:
            hint = (f" ({len(ignored)} names are in torch's ignore list, _ddp_params_and_buffers_to_ignore)"
                    if ignored else "")
            raise NothingToTrainError(
                f"{type(self.module).__name__} has no parameters that require a gradient{hint}, so "
                "there is nothing for data parallelism to synchronise. Check that the model "
                "is not frozen (requires_grad=False everywhere) and that its layers are "
                "registered as submodules (nn.ModuleList, not a Python list).")

    def __getattr__(self, name: str) -> Any:
        """nn.Module's lookup of submodules, parameters and buffers; a name of torch's class that dptrain refuses
        raises AttributeError saying what to use instead (nn.Module's own message would hide it)."""
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            message = refusal(type(self), name)
            if message is None:
                raise
            raise AttributeError(message) from None

    # ---------------------------------------------------------------------- forward

    @skip_frame
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Broadcast buffers if due, run the module (compiled or not: [Note: compiled graphs split at bucket
        boundaries]), then prepare the reducer for the backward through the outputs, returned untouched.

        Under ``torch.compile(ddp_model)`` dynamo skips this frame: the wrapper's steps run eagerly and the
        module's forward is compiled as a frame of its own, split at bucket boundaries.
        """
        with torch.autograd.profiler.record_function("dptrain.DistributedDataParallel.forward"):
            inputs, kwargs, forward_comm = self._pre_forward(inputs, kwargs)
            output = run_module(self, self.module, inputs, kwargs)
            return self._post_forward(output, forward_comm)

    @eager
    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, tuple[int, int]]:
        """Join's notification, the buffer broadcast if due, inputs moved to ``device_ids``; the inputs and the
        (calls, bytes) communicated."""
        if self.device_ids:
            inputs, kwargs = map_tensors((inputs, kwargs), lambda t: t.to(self.device, non_blocking=True))
        return inputs, kwargs, self._notify_and_sync()

    def _notify_and_sync(self) -> tuple[int, int]:
        self._forward_calls += 1
        join_work = Join.notify_join_context(self)
        if join_work is not None and not self._divide_by_initial_world_size:
            join_work.wait()  # its result is the number of ranks that still have data
            self.reducer.divisor = int(join_work.result()[0].item())
        else:
            self.reducer.divisor = dist.get_world_size(self.process_group)
        comm = (0, 0)
        if self._will_sync_buffers():
            comm = self._sync_buffers(is_active=True)
        if self._join_config.enable:
            self._agree_on_grad_sync(is_joined=False)
        return comm

    @eager
    def _post_forward(self, output: Any, forward_comm: tuple[int, int]) -> Any:
        if not torch.is_grad_enabled():
            self.require_forward_param_sync = False
            return output
        if not self.require_backward_grad_sync:
            self.require_forward_param_sync = False
            self.reducer.prepare_for_accumulation()
            return output
        self.require_forward_param_sync = True
        generation = self.reducer.prepare_for_backward(list(iter_tensors(output)), forward_comm)
        on_backward_reaching(output, self.reducer.backward_callback(generation))
        return output

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (torch's public name)."""
        return self._will_sync_buffers()

    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[int]) -> tuple[tuple, tuple]:
        """torch's helper kept for backward compatibility: split inputs along ``dim`` over ``device_ids``."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        """torch's helper kept for backward compatibility: concatenate outputs along ``dim`` on ``output_device``."""
        return gather(outputs, output_device, dim=self.dim)

    def to_kwargs(self, inputs: tuple, kwargs: dict, device_id: int) -> tuple[tuple, tuple]:
        """torch's helper kept for backward compatibility: inputs moved to ``device_id``, as one-element tuples."""
        device = torch.device(self.device.type, device_id) if self.device.type != "cpu" else self.device
        moved_inputs, moved_kwargs = map_tensors((inputs, kwargs or {}), lambda t: t.to(device))
        return (tuple(moved_inputs),), (moved_kwargs,)

    def _will_sync_buffers(self) -> bool:
        return self.forward_sync_buffers and self.require_forward_param_sync and bool(self._synced_buffers)

    def _sync_buffers(self, is_active: bool) -> tuple[int, int]:
        """Broadcast buffers from rank 0, or under Join from the highest rank with data."""
        src = 0
        if self._join_config.enable:
            src = self._highest_rank_where(is_active)
        return broadcast_coalesced(self._synced_buffers, src, self.process_group)

    def _highest_rank_where(self, condition: bool) -> int:
        rank = dist.get_rank(self.process_group)
        candidate = torch.tensor([rank if condition else -1], device=self.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(candidate.item())

    def _agree_on_grad_sync(self, is_joined: bool) -> bool:
        """Under Join: tell joined ranks whether this step's backward communicates."""
        wants_sync = (not is_joined) and self.require_backward_grad_sync
        flag = torch.tensor([1.0 if wants_sync else 0.0], device=self.device)
        dist.all_reduce(flag, group=self.process_group)
        return bool(flag.item() > 0)

    # ------------------------------------------------------------ runtime switches

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the default hook (``SumAllReduce``: an all-reduce of ``algorithm``) with ``hook(state, bucket) -> handle``.

        See :mod:`dptrain.ddp.comm_hooks` for the protocol; torch's DDP hooks work as is.
        Must be called once, before the first forward.
        """
        if self._comm_hook_registered:
            raise RuntimeError("register_comm_hook can only be called once per model")
        if self._forward_calls:
            raise RuntimeError("register_comm_hook must be called before the first forward")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self.reducer.register_comm_hook(state, hook)
        self._comm_hook_registered = True

    def optimizer_in_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` inside backward, each bucket's parameters as soon as its all-reduce completes.

        The update overlaps the remaining buckets' communication; ``optimizer.step()`` afterwards
        steps nothing twice (see :mod:`dptrain.ddp.optimizer_in_backward` for when this is exact:
        not with a global-norm clip or ``GradScaler``, which need every gradient first).
        """
        if self.reducer.bucket_optimizer is not None:
            raise RuntimeError("optimizer_in_backward can be called once per model")
        self.reducer.bucket_optimizer = BucketOptimizer(optimizer, self.reducer.params)

    @property
    def last_step_comm(self) -> StepCommStats:
        """Calls, bytes and timing of the most recent synced step (this rank)."""
        return self.reducer.last_stats

    def record_comm_spans(self, on: bool) -> None:
        """Stamp each bucket's reduction with its exact completion time (a callback on its work), for traces."""
        self.reducer.record_spans = on

    def before_optimizer_step(self) -> None:
        """Nothing: backward left every rank the averaged gradients (the wrapper protocol's hook for gossip)."""

    # the rest of dptrain's wrapper protocol (strategies/protocol.py): nothing differs between replicas

    def after_optimizer_step(self) -> None:
        """Nothing: every replica took the same step."""

    def step_metrics(self) -> dict[str, float]:
        return {}  # its buckets' statistics are last_step_comm's

    def finish(self) -> None:
        """Collective: rank 0's buffers on every rank (each rank's last forward moved its own), unless they are
        rank-local by choice (``broadcast_buffers=False``); the parameters are equal already."""
        if self.forward_sync_buffers:
            broadcast_buffers_(self.module, self.process_group)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        return {}  # the replicated model and optimizer are everything it holds

    def load_checkpoint_state(self, state: dict, optimizer: torch.optim.Optimizer) -> str | None:
        return None

    def evaluating(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The bare module: an evaluation needs no gradient hooks and no buffer broadcast."""
        return contextlib.nullcontext(self.module)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict, no communication (as torch's DDP, so a rank-0-only call cannot hang): the
        parameters are equal on every rank; the buffers are this rank's, rank 0's on every rank after :meth:`finish`."""
        return self.module.state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)

    def export_weights(self, path) -> Any:
        """Rank 0 writes the module's state dict (:mod:`dptrain.utils.weights_file`); the others nothing."""
        from dptrain.utils.weights_file import save_replica_weights

        return save_replica_weights(self.module, path)

    @property
    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._param_names[i] for i in b.param_indices] for b in self.reducer.buckets]

    # ------------------------------------------------------------- uneven inputs

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs: ranks that run out of data keep shadowing.

        Equivalent to ``torch.distributed.algorithms.join.Join([self], ...)``. With
        ``divide_by_initial_world_size=True`` (the default) gradients are always divided
        by the full world size, so a joined rank counts as contributing zeros; with
        False, by the number of ranks that still have data.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        src = self._highest_rank_where(is_last_joiner)
        tensors = self._managed("parameters")
        if self.forward_sync_buffers:
            tensors += self._synced_buffers
        broadcast_coalesced(tensors, src, self.process_group)


def _trainable_parameters(module: nn.Module, ignored: set[str]) -> list[tuple[str, nn.Parameter]]:
    lazy = [name for name, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise RuntimeError(f"parameters {lazy} are uninitialised (lazy modules such as nn.LazyLinear): run one forward "
                           "on a sample batch before wrapping the model, so that their shapes are known")
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad and name not in ignored]


def _module_device(module: nn.Module) -> torch.device:
    """The one device holding the module's parameters (CPU for a module without any)."""
    where = {str(p.device): name for name, p in module.named_parameters()}
    if len(where) > 1:
        raise ValueError(f"parameters are on several devices (e.g. {where}); move the module to one "
                         "device (one process per device) before wrapping it")
    return next(module.parameters()).device if where else torch.device("cpu")
