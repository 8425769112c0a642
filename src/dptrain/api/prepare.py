"""``prepare()``: an ordinary training loop made data-parallel, as Hugging Face Accelerate's is.

``prepare(model, optimizer, loader, scheduler, ...)`` recognises each object by its type and
returns a wrapped one in the same place, so the loop stays the one a single process runs
(``loss.backward(); optimizer.step(); scheduler.step(); optimizer.zero_grad()``). The
wrappers share one :class:`AccumulationState`; gradient accumulation is a window of
``grad_accum_steps`` micro-steps, a micro-step being one forward of the model with autograd on:

1. the model's forward counts the micro-step; the ``grad_accum_steps``-th closes the window,
   and so does the last batch of a prepared loader's pass (a pass that is not a multiple of
   ``grad_accum_steps`` ends on a shorter window, as in Accelerate). The others run under the
   strategy's ``no_sync()``, held open until the closing forward: gradients add up locally
   and the closing backward reduces their sum once;
2. ``optimizer.step()`` does nothing inside a window. At its close it takes the step both user
   APIs share (:mod:`dptrain.api.step`): it divides the gradients by the window's micro-step
   count ``k`` (each loss is a micro-batch mean and DDP averages over ranks, so the gradient
   becomes the mean over the window's global batch), clips by the global norm, and steps
   unless the norm is not finite (the same on every rank, so all ranks skip together);
3. ``optimizer.zero_grad()`` does nothing inside a window; ``scheduler.step()`` steps when it
   closes, unless the optimizer skipped its step: once per process (``world_size`` times) by
   default, as Accelerate does, so a schedule written for one process over the loader
   ends where it meant to; once with ``scheduler_steps="per_step"`` (:mod:`dptrain.api.scheduler`).

The loader is rebuilt over the same dataset with :class:`~dptrain.data.sampler.DistributedSampler`
(``batch_size`` per rank). The model is wrapped by the strategy's registry entry
(:mod:`dptrain.api.wrap`); a strategy that shards the parameters (zero1-3) gets the optimizer
moved onto its flat shards in place (as Accelerate does for FSDP2).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from dptrain.api.accumulation import AccumulationState
from dptrain.api.prepared_model import PreparedModel
from dptrain.api.scheduler import SCHEDULER_STEPS, PreparedScheduler, steps_per_optimizer_step
from dptrain.api.step import OptimizerStep
from dptrain.api.wrap import autocast_dtype, options_for, user_api_entry, wrap_model
from dptrain.data.loader import set_epoch
from dptrain.data.sampler import DistributedSampler
from dptrain.strategies.protocol import DataParallelWrapper
from dptrain.strategies.registry import Strategy, strategy_names
from dptrain.utils.tensors import map_tensors

__all__ = ["prepare", "AccumulationState", "PreparedModel", "PreparedOptimizer", "PreparedScheduler",
           "PreparedLoader", "shard_loader", "scheduler_steps_per_epoch", "STRATEGIES", "PRECISIONS",
           "SCHEDULER_STEPS"]

STRATEGIES = strategy_names(lambda s: s.wrap is not None)  # those whose wrapper the registry builds (not ps)
PRECISIONS = ("fp32", "bf16")


def prepare(*objects: Any, strategy: str = "ddp", precision: str = "fp32", grad_accum_steps: int = 1,
            grad_clip: float = 0.0, device: torch.device | str | None = None,
            process_group: dist.ProcessGroup | None = None, seed: int = 0, options: Any = None,
            ddp_kwargs: dict | None = None, zero_kwargs: dict | None = None, gossip_kwargs: dict | None = None,
            scheduler_steps: str = "per_process") -> Any:
    """Wrap a model, optimizers, DataLoaders and LR schedulers for data parallelism; return them in order.

    Against :class:`~dptrain.api.engine.Engine`: the loop stays an ordinary one, at the cost
    of inferring the accumulation window from forwards and loader passes (module docstring).

    - ``strategy``: a registered strategy: ``"ddp"`` (dptrain's DistributedDataParallel),
      ``"zero1"``/``"zero2"``/``"zero3"`` (:class:`dptrain.zero.ZeRO`; at most one optimizer, created
      over the unwrapped model and not yet stepped), ``"gossip"``
      (:class:`dptrain.gossip.GossipDataParallel`: the parameters are mixed with the neighbours'
      before each optimizer step, and each rank clips by its own gradient's norm), ``"localsgd"`` or
      ``"diloco"`` (each rank steps alone; the models are averaged, or an outer step taken, every
      few steps). Those whose replicas are not equal after every step take one optimizer.
    - ``options``: the strategy's options object (``LocalSGDOptions``, ``DiLoCoOptions``...) or a
      dict of its wrapper's keyword arguments; ``ddp_kwargs``, ``zero_kwargs``, ``gossip_kwargs``:
      the same, by the keyword each strategy took before ``options=``.
    - ``precision``: ``"fp32"`` or ``"bf16"``: autocast around the forward with fp32 weights and
      outputs cast back to fp32 (under ZeRO its own ``MixedPrecision``, fp32 master shards).
    - ``grad_accum_steps``: micro-steps per optimizer step; ``grad_clip``: max global L2 norm (0: none).
    - ``device``: default ``cuda:<current>`` with NCCL, else CPU; ``process_group``: default the world.
    - ``seed``: the loaders' shuffling seed (epoch ``e`` draws the permutation of ``seed + e``).
    - ``scheduler_steps``: ``"per_process"`` steps the LR schedulers ``world_size`` times per
      optimizer step (Accelerate's rule: a schedule written for one process over the loader you
      passed ends where it meant to), ``"per_step"`` once (a schedule in this run's optimizer
      steps). :func:`scheduler_steps_per_epoch` gives the exact count.

    One object returns it alone, several a tuple. Anything but a module, an optimizer, a
    DataLoader or an LR scheduler is a TypeError.
    """
    entry = _check_settings(strategy, precision, grad_accum_steps, grad_clip)
    steps_per_optimizer_step(scheduler_steps, 1)  # a ValueError naming both choices
    if not dist.is_initialized():
        raise RuntimeError("prepare() needs torch.distributed initialised: call device = dptrain.init_distributed() "
                           "first (torchrun, Slurm or a single process)")
    kinds = [_kind(obj) for obj in objects]
    picked = {kind: list({id(o): o for o, k in zip(objects, kinds, strict=True) if k == kind}.values())
              for kind in ("model", "optimizer", "scheduler", "loader")}
    _check_optimizer_count(entry, len(picked["optimizer"]))
    if len(picked["model"]) > 1:
        raise ValueError(f"prepare() got {len(picked['model'])} models; it counts one model's forwards as the "
                         "accumulation's micro-steps. Put the models in one nn.Module, or prepare each with its own "
                         "optimizers in separate prepare() calls")
    device = torch.device(device) if device is not None else _default_device(process_group)
    state = AccumulationState(grad_accum_steps)
    done: dict[int, Any] = {}
    wrapper = None
    options = options_for(entry, options, ddp_kwargs=ddp_kwargs, zero_kwargs=zero_kwargs, gossip_kwargs=gossip_kwargs)
    for model in picked["model"]:
        done[id(model)] = prepared = _prepare_model(model, picked["optimizer"], entry, precision, device,
                                                    process_group, state, options)
        wrapper = prepared.wrapper
    for optimizer in picked["optimizer"]:
        done[id(optimizer)] = PreparedOptimizer(optimizer, state, grad_clip, wrapper,
                                                sharded=entry.shards_parameters)
    world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    for scheduler in picked["scheduler"]:
        done[id(scheduler)] = PreparedScheduler(scheduler, _optimizer_of(scheduler, done), state,
                                                steps_per_optimizer_step(scheduler_steps, world))
    for loader in picked["loader"]:
        done[id(loader)] = PreparedLoader(shard_loader(loader, world, rank, seed), state, device)
    result = tuple(done[id(obj)] for obj in objects)
    return result[0] if len(result) == 1 else result


# ----------------------------------------------------------------------------- the model


def _prepare_model(model: nn.Module, optimizers: list[torch.optim.Optimizer], entry: Strategy, precision: str,
                   device: torch.device, group: dist.ProcessGroup | None, state: AccumulationState,
                   options: dict | None) -> PreparedModel:
    model = model.to(device)  # the same Parameter objects: an optimizer built over them stays valid
    if entry.shards_parameters:
        wrapped = _wrap_sharded(entry, model, optimizers, precision, group, options)
    else:
        wrapped = wrap_model(entry, model, precision=precision, process_group=group, options=options)
    return PreparedModel(wrapped, entry, state, autocast_dtype(entry, precision), device)


def _wrap_sharded(entry: Strategy, model: nn.Module, optimizers: list[torch.optim.Optimizer], precision: str,
                  group: dist.ProcessGroup | None, options: dict | None) -> nn.Module:
    """The sharding wrapper (ZeRO) over ``model``, the optimizer's groups switched in place onto its shards.

    ZeRO flattens parameters into units and shards each unit. ``split_by`` keeps parameters
    of different param groups in different units, so every shard belongs to one group and
    the group's hyperparameters apply to exactly the parameters they applied to before.
    """
    options = dict(options or {})
    if "split_by" in options or "mixed_precision" in options:
        raise ValueError(f"{entry.options_argument or 'options'} may not set split_by or mixed_precision (nor may "
                         "options=, which carries the same): prepare() derives them from the optimizer's param groups "
                         "and precision=")
    group_of = {id(p): j for optimizer in optimizers for j, g in enumerate(optimizer.param_groups)
                for p in g["params"]}
    for optimizer in optimizers:
        _check_movable(optimizer, entry.name)
    replaced = {id(p) for p in model.parameters() if p.requires_grad}  # what ZeRO turns into shards
    options["split_by"] = lambda name, p: group_of.get(id(p))
    wrapper = wrap_model(entry, model, precision=precision, process_group=group, options=options,
                         output_dtype=torch.float32)  # the loss is computed outside, in fp32
    for optimizer in optimizers:
        for j, g in enumerate(optimizer.param_groups):
            others = [p for p in g["params"] if id(p) not in replaced]  # not the model's: kept as they are
            g["params"] = others + wrapper.sharded_parameters(j)
    return wrapper


def _check_optimizer_count(entry: Strategy, count: int) -> None:
    """Sharding clips and scales the whole model once per step, and a strategy whose replicas differ acts on the whole
    model at each step (gossip mixes it, local SGD averages it): one optimizer then."""
    if count <= 1 or (entry.replicated_state and not entry.shards_parameters):
        return
    once = ("the gradient clipping and scaling are over the whole sharded model" if entry.shards_parameters
            else "its replicas differ, and it acts on the whole model at each optimizer step")
    able = " or ".join(f"strategy={n!r}" for n in strategy_names(lambda s: s.replicated_state
                                                                  and not s.shards_parameters))
    raise ValueError(f"strategy {entry.name} with {count} optimizers: {once}, once per step. Use one optimizer "
                     f"with a param group per part, or {able}")


def _check_movable(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    if optimizer.state:
        raise ValueError(f"the {type(optimizer).__name__} already has state for {len(optimizer.state)} parameters "
                         f"(it stepped, or loaded a checkpoint); {strategy} replaces the parameters by flat shards, "
                         "so that state cannot follow them. prepare() it before its first step, and resume from a "
                         "sharded checkpoint afterwards: dptrain.zero.checkpoint.load_sharded(path, model.wrapper, "
                         "optimizer.optimizer)")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"LBFGS keeps its own list of parameters, which cannot be moved onto {strategy}'s "
                         "shards; use strategy='ddp'")


# ------------------------------------------------------------------- optimizer and scheduler


class PreparedOptimizer(torch.optim.Optimizer):
    """The optimizer, stepping and zeroing only when an accumulation window closes.

    At the close, ``step()`` takes the step both user APIs share (:class:`~dptrain.api.step.OptimizerStep`):
    it divides the gradients by the window's micro-step count, clips by the global norm
    (``grad_clip``; under ZeRO over every rank's shard) and steps unless the norm is not finite;
    ``zero_grad()`` is left to the loop. ``grad_norm`` (before clipping), ``steps``,
    ``skipped_steps`` and ``step_was_skipped`` describe the last step; ``accumulation`` is the
    shared state. Like Accelerate's AcceleratedOptimizer it subclasses ``torch.optim.Optimizer``
    (LR schedulers accept it) without calling its ``__init__``: param groups and state are the
    wrapped optimizer's, and any other attribute is looked up there.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: AccumulationState, grad_clip: float,
                 wrapper: nn.Module | None = None, sharded: bool = False):
        self.optimizer = optimizer
        self.accumulation = state
        self.core = OptimizerStep(optimizer, wrapper, grad_clip=grad_clip, sharded=sharded)
        self.grad_norm: float | None = None
        self.step_was_skipped = False
        self._stepped_window = -1  # the window this optimizer last stepped in

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)
    grad_clip = property(lambda self: self.core.grad_clip)
    steps = property(lambda self: self.core.steps - self.core.skipped_steps, doc="Optimizer steps taken.")
    skipped_steps = property(lambda self: self.core.skipped_steps, doc="Windows whose step was skipped.")

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "core"):  # not set yet (copy, unpickling): no wrapped optimizer to ask
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        acc = self.accumulation
        if not acc.sync_gradients or self._stepped_window == acc.window:
            return None
        self._stepped_window = acc.window
        outcome = self.core(acc.micro_step, closure, zero_grad=False)
        self.grad_norm, self.step_was_skipped = outcome.grad_norm, outcome.skipped
        return outcome.result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.accumulation.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)


def _optimizer_of(scheduler: LRScheduler, done: dict[int, Any]) -> PreparedOptimizer | None:
    if isinstance(scheduler.optimizer, PreparedOptimizer):  # built on an optimizer prepared earlier
        return scheduler.optimizer
    prepared = done.get(id(scheduler.optimizer))
    return prepared if isinstance(prepared, PreparedOptimizer) else None


# ----------------------------------------------------------------------------- the data


class PreparedLoader:
    """A DataLoader over this rank's shard: ``set_epoch`` before each pass, batches moved to the device.

    Each ``iter()`` is one pass over epoch ``epoch``: the sampler (and a dataset with
    ``set_epoch``) is told it first, so every epoch is reshuffled, and a pass that runs to its
    end moves ``epoch`` on by one (save it, ``set_epoch`` it to resume). While the pass yields
    its last batch it marks the end of data: the forward on that batch closes the accumulation
    window. Other attributes (``dataset``, ``batch_size``, ``sampler``) are the DataLoader's.
    """

    def __init__(self, loader: DataLoader, state: AccumulationState, device: torch.device):
        self.loader, self.accumulation, self.device = loader, state, device
        self.epoch = 0  # the epoch of the pass in progress, or of the next one

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (to resume)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        if hasattr(self.loader.sampler, "set_epoch"):
            self.loader.sampler.set_epoch(epoch)
        set_epoch(self.loader.dataset, epoch)
        last = len(self.loader) - 1
        try:
            for i, batch in enumerate(self.loader):
                self.accumulation.end_of_data = i == last
                yield map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
            self.epoch = epoch + 1
        finally:
            self.accumulation.end_of_data = False

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def scheduler_steps_per_epoch(loader: DataLoader, *, grad_accum_steps: int = 1, world_size: int | None = None,
                              scheduler_steps: str = "per_process") -> int:
    """The steps a prepared scheduler takes in one pass over ``loader``: its ``T_max`` per epoch. Call it before prepare().

    ``loader`` is the DataLoader as you pass it to ``prepare()`` (batch size per rank);
    ``world_size`` defaults to the initialised process group's. The count is exact: one
    rank's shard, padded as prepare() pads it, in whole batches (or, with ``drop_last``,
    the whole ones), in accumulation windows of ``grad_accum_steps`` (the pass's last one
    may be shorter), times the scheduler's steps per optimizer step.
    """
    if world_size is None:
        if not dist.is_initialized():
            raise RuntimeError("scheduler_steps_per_epoch() needs the world size: call device = "
                               "dptrain.init_distributed() first, or pass world_size=")
        world_size = dist.get_world_size()
    per_step = steps_per_optimizer_step(scheduler_steps, world_size)
    if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}")
    batches = len(shard_loader(loader, world_size, 0))  # every rank's shard has as many
    return -(-batches // grad_accum_steps) * per_step


def shard_loader(loader: DataLoader, world_size: int, rank: int, seed: int = 0) -> DataLoader:
    """``loader`` rebuilt over rank ``rank``'s :class:`DistributedSampler` shard; its settings kept.

    ``batch_size`` stays the batch per rank. A RandomSampler becomes a shuffled shard, a
    SequentialSampler an ordered one; a DistributedSampler (dptrain's or torch's) is kept as
    it is. The shard is padded to equal length on every rank (``drop_last`` of the sampler
    is False), so every rank has the same number of batches and the ranks close their last
    window together.
    """
    sampler = _shard_sampler(loader, world_size, rank, seed)
    options = dict(batch_size=loader.batch_size, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                   pin_memory=loader.pin_memory, drop_last=loader.drop_last, timeout=loader.timeout,
                   worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
                   generator=loader.generator, persistent_workers=loader.persistent_workers,
                   in_order=loader.in_order)
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    if loader.pin_memory_device:
        options["pin_memory_device"] = loader.pin_memory_device
    return DataLoader(loader.dataset, sampler=sampler, **options)


def _shard_sampler(loader: DataLoader, world_size: int, rank: int, seed: int) -> Any:
    name = f"the DataLoader's {type(loader.sampler).__name__}"
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(f"{type(loader.dataset).__name__} is an IterableDataset, which has no indices to shard: "
                        "have it yield rank torch.distributed.get_rank()'s part itself and iterate that DataLoader "
                        "without prepare()")
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise TypeError(f"the DataLoader's batch_sampler is a {type(loader.batch_sampler).__name__}: prepare() "
                        "rebuilds a loader from batch_size and a sampler only. Build it with batch_size= and "
                        "shuffle=, or shard your batch sampler by rank yourself and leave the loader unprepared")
    sampler = loader.sampler
    if isinstance(sampler, (DistributedSampler, TorchDistributedSampler)):
        if sampler.num_replicas != world_size or sampler.rank != rank:
            raise ValueError(f"{name} is for rank {sampler.rank} of {sampler.num_replicas}, this is rank {rank} of "
                             f"{world_size}; let prepare() shard a plain DataLoader (shuffle=True or False)")
        return sampler
    if type(sampler) is RandomSampler and (sampler.replacement or sampler.num_samples != len(loader.dataset)):
        raise TypeError(f"{name} draws {sampler.num_samples} samples (replacement={sampler.replacement}); "
                        "prepare() shards a permutation of the whole dataset. Use shuffle=True without num_samples")
    if type(sampler) not in (RandomSampler, SequentialSampler):
        raise TypeError(f"{name} is not one prepare() can shard faithfully (it knows RandomSampler, from "
                        "shuffle=True; SequentialSampler, from shuffle=False; and DistributedSampler). Use "
                        "shuffle=, or pass sampler=dptrain.DistributedSampler(dataset, num_replicas=world_size, "
                        "rank=rank) yourself")
    return DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                              shuffle=type(sampler) is RandomSampler, seed=seed, drop_last=False)


# ----------------------------------------------------------------------------- helpers


def _kind(obj: Any) -> str:
    if isinstance(obj, (PreparedModel, PreparedOptimizer, PreparedScheduler, PreparedLoader)):
        raise TypeError(f"this {type(obj).__name__} was already prepared; pass the original object")
    if isinstance(obj, (DataParallelWrapper, nn.parallel.DistributedDataParallel)):
        raise TypeError(f"the model is already wrapped in {type(obj).__name__}; pass the bare module, prepare() "
                        "wraps it for strategy=")
    for kind, types in (("model", nn.Module), ("optimizer", torch.optim.Optimizer), ("scheduler", LRScheduler),
                        ("loader", DataLoader)):
        if isinstance(obj, types):
            return kind
    hint = " (a Dataset: wrap it in a DataLoader first)" if isinstance(obj, Dataset) else ""
    raise TypeError(f"prepare() does not know what to do with a {type(obj).__name__}{hint}; it takes an "
                    "nn.Module, torch.optim.Optimizers, torch.utils.data.DataLoaders and LR schedulers")


def _check_settings(strategy: str, precision: str, grad_accum_steps: int, grad_clip: float) -> Strategy:
    """The registry entry for ``strategy``, once every setting is known to be valid."""
    entry = user_api_entry(strategy, "prepare()")  # a ValueError: unknown (did you mean), or runs its own loop
    if precision == "fp16":
        raise ValueError("precision fp16 needs a loss scaler, which a plain loss.backward() cannot apply; use bf16 "
                         "(no scaler needed), or dptrain.Engine(precision='fp16') on CUDA")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}{_did_you_mean(precision, PRECISIONS)}; use fp32 or bf16")
    if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}")
    if not grad_clip >= 0:
        raise ValueError(f"grad_clip must be >= 0 (0: no clipping), got {grad_clip!r}")
    return entry


def _did_you_mean(value: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value).lower(), choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
