"""One :class:`Strategy` per name: the facts every layer above needs, how to wrap a model, and its own rules.

The strategies' own packages (``dptrain.ddp``, ``dptrain.zero``, ``dptrain.gossip``,
``dptrain.ps``, ``dptrain.localsgd``, ``dptrain.diloco``) implement them; this module
describes each once, for the validation of a run, the user API (``Engine``,
``prepare()``), the job runner, the planner and the pages. torchtitan's registry is the
model: a component is looked up by name in one place and every caller goes through it.
An entry's functions import their package when called, so looking a strategy up costs
nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptrain.compress.codecs import CODECS  # the DDP engine's compression hook runs each on its buckets
from dptrain.compress.zero import ZERO_CODECS  # ZeRO's reduce-scatter runs these shard by shard
from dptrain.strategies.options import (
    SyncSchedule,
    ddp_compression,
    ddp_options,
    ddp_units,
    gossip_options,
    ps_check,
    ps_check_model,
    ps_check_resume,
    ps_expendable,
    ps_program,
    zero_check,
    zero_check_live,
    zero_check_model,
    zero_check_shards,
    zero_compression,
    zero_options,
    zero_units,
)

__all__ = ["Strategy", "REGISTRY", "get_strategy", "strategy_names", "did_you_mean", "checkpoint_writers"]


@dataclass(frozen=True)
class Strategy:
    """What dptrain knows of one data-parallel strategy.

    Facts (each a capability, never a stand-in for a name):

    - ``zero_stage``: what the planner's memory and traffic formulas take it to shard, as ZeRO's
      stages count: 0 nothing (every rank holds everything), 1 the optimizer state, 2 and the
      gradients, 3 and the parameters; None where the planner has no model of it;
    - ``planned``: the planner's memory and traffic model covers it (a property: its entry lays
      out its communication units, ``units``, and has a ``zero_stage``), so ``dptrain plan``,
      ``simulate``, ``tune`` and the pages can show it;
    - ``shards_parameters``: the wrapper replaces the parameters with shards, so an optimizer
      is built after wrapping and the gradient's norm is the wrapper's to take;
    - ``casts_itself``: the wrapper applies mixed precision itself (its own master weights),
      so the user API does not autocast;
    - ``replicated_state``: every rank holds the same parameters and optimizer state after a
      step (what the divergence monitor compares);
    - ``checkpoint_layout``: ``replicated`` (rank 0 writes model.pt/optimizer.pt), ``sharded``
      (every rank writes its shards through DCP: the wrapper is a
      :class:`~dptrain.strategies.protocol.ShardedWrapper`), ``ps`` (the servers' shards);
    - ``codecs``: the values of ``compression.method`` it accepts besides ``none``; where there
      are none, ``uncompressed``: why, completing "strategy NAME ...";
    - ``own_loop``: the job runner runs its own program (``program``) instead of the SPMD
      loop (the parameter server: servers and workers run different programs);
    - ``buckets``: ``ddp.bucket_cap_mb`` applies; ``dynamic_batching``: ranks may take unequal
      shares of the global batch; ``comm_hooks``: the wrapper takes a communication hook
      (``register_comm_hook``), which 1-bit Adam replaces the gradient all-reduce with;
      ``optimizer_in_backward``: the wrapper can step the optimizer bucket by bucket inside
      backward;
    - ``live``: how live recovery (``live.enabled``) serves it: ``step`` (a round every step,
      the gradients averaged over its members through the wrapper's comm hook), ``meeting`` (a
      round only where the replicas meet: the wrapper is a
      :class:`~dptrain.strategies.protocol.MeetingWrapper`), or empty (it cannot).

    Functions (called with the run's config; the library below never reads it):

    - ``wrap(model, process_group, options, precision, output_dtype) -> module``: a module
      satisfying :class:`~dptrain.strategies.protocol.DataParallelWrapper` (None for
      ``own_loop``); ``options`` is what ``options(cfg, model, nodes)`` returns, or what a user
      passed to ``Engine`` / ``prepare()``: its options object, or a dict of its keyword arguments;
    - ``check(cfg, world_size) -> int``: its own settings checked (a ValueError naming the
      values and the fix); returns the ranks that take data;
    - ``check_model(cfg, model)``, ``check_resume(path, meta, cfg, world_size)``: what only it
      can say about a model or a checkpoint, before launch;
    - ``compression(cfg, wrapper) -> compressor | None``: ``compression.method`` applied to the
      built wrapper (a comm hook, or its own compressed reduce-scatter);
    - ``expendable(cfg, world_size) -> set[int]``: ranks whose death the run survives;
    - ``program(ctx)``: its own program (``own_loop``), given the runner's lifecycle
      (:class:`~dptrain.runner.lifecycle.ProgramContext`); rank 0 returns the run's facts;
    - ``units(model, *, bucket_cap_mb, last_bucket_cap_mb, unit_classes, min_unit_numel,
      reshard_after_forward, split_by)``: its communication units for ``model`` (any device, meta
      included) as its wrapper would build them, for the planner (None: not ``planned``); each takes
      the options that apply to it and ignores the others;
    - ``check_live(cfg, world_size)``: its own settings checked against live recovery (a ValueError
      naming the values and the fix);
    - ``live_group(cfg) -> int``: how many consecutive workers hold one replica between them under
      live recovery (hybrid sharding's shard group, :mod:`dptrain.live.layout`); None: each worker
      a whole replica;
    - ``check_shards(shard_size, world_size)``: hybrid sharding's groups of ``shard_size`` ranks
      checked against the world (a ValueError naming the divisors), for a strategy that shards;
    - ``sync_schedule(cfg, model) -> SyncSchedule``: for a strategy whose replicas step alone and
      meet every few steps, what its meetings reduce and when (the simulator's model of its step,
      :mod:`dptrain.planner.periodic`, and ``dptrain tune``'s).

    ``options_argument``: the keyword ``Engine`` and ``prepare()`` took its options by before
    ``options=`` (``ddp_kwargs``, ``zero_kwargs``, ``gossip_kwargs``), still accepted. ``label``:
    its name as people write it (``DDP``, ``ZeRO-3``), for pages and tables; the name where empty.
    """

    name: str
    summary: str
    zero_stage: int | None
    shards_parameters: bool
    replicated_state: bool
    checkpoint_layout: str
    casts_itself: bool = False
    codecs: tuple[str, ...] = ()
    uncompressed: str = ""
    own_loop: bool = False
    buckets: bool = True
    dynamic_batching: bool = False
    comm_hooks: bool = False
    optimizer_in_backward: bool = False
    live: str = ""
    roles: tuple[str, str] = ("ranks", "other ranks")  # what its ranks that take data, and the others, are called
    options_argument: str = ""
    label: str = ""
    wrap: Callable[..., nn.Module] | None = None
    options: Callable[..., Any] | None = None
    check: Callable[[Any, int], int] | None = None
    check_model: Callable[[Any, nn.Module], None] | None = None
    check_resume: Callable[..., None] | None = None
    compression: Callable[[Any, nn.Module], Any] | None = None
    expendable: Callable[[Any, int], set[int]] | None = None
    program: Callable[[Any], Any] | None = None
    units: Callable[..., list] | None = None
    check_live: Callable[[Any, int], None] | None = None
    live_group: Callable[[Any], int] | None = None
    check_shards: Callable[[int, int], None] | None = None
    sync_schedule: Callable[[Any, nn.Module], SyncSchedule] | None = None

    def __post_init__(self):
        if (self.units is not None) != (self.zero_stage is not None):
            raise ValueError(f"strategy {self.name!r}: the planner needs both its units and its zero_stage, or "
                             f"neither (units {'given' if self.units else 'none'}, zero_stage {self.zero_stage})")

    @property
    def planned(self) -> bool:
        """The planner's memory and traffic model covers it (``dptrain plan``, ``simulate``, ``tune``, the pages)."""
        return self.units is not None

    def accepts_codec(self, codec: str) -> bool:
        return codec == "none" or codec in self.codecs

    def data_ranks(self, cfg: Any, world_size: int) -> int:
        """The ranks that take data, once its own settings are checked (:attr:`check`)."""
        return self.check(cfg, world_size) if self.check is not None else world_size


def _keywords(options: Any, name: str, takes: str) -> dict[str, Any]:
    """A user's options as keyword arguments: a dict (what ``ddp_kwargs=`` carried), or none; anything else is a
    TypeError naming the strategy ``name`` and what it ``takes``."""
    if options is None:
        return {}
    if isinstance(options, dict):
        return dict(options)
    raise TypeError(f"strategy {name!r} takes {takes}, got {type(options).__name__}")


def _keywords_wrapper(name: str, module: str, wrapper: str) -> Callable[..., nn.Module]:
    """``wrap`` for a wrapper taking its options as keyword arguments (``module:wrapper``), for strategy ``name``."""
    def wrap(model: nn.Module, process_group=None, options: Any = None, precision: str = "fp32",
             output_dtype: torch.dtype | None = None) -> nn.Module:
        import importlib

        keywords = _keywords(options, name, f"a dict of {wrapper}'s keyword arguments")
        return getattr(importlib.import_module(module), wrapper)(model, process_group=process_group, **keywords)
    return wrap


def _zero_wrapper(stage: int) -> Callable[..., nn.Module]:
    def wrap(model: nn.Module, process_group=None, options: Any = None, precision: str = "fp32",
             output_dtype: torch.dtype | None = None) -> nn.Module:
        from dptrain.zero import MixedPrecision, ZeRO

        keywords = _keywords(options, f"zero{stage}", "a dict of ZeRO's keyword arguments (its policies among them)")
        reduce_dtype = keywords.pop("reduce_dtype", torch.float32)  # [zero] reduce_dtype: bf16's reductions
        if precision == "fp16":
            raise ValueError(f"precision fp16 is not supported with strategy zero{stage} (it needs a loss scaler "
                             "over sharded gradients); use bf16, which needs none")
        if precision == "bf16":
            if "mixed_precision" in keywords:
                raise ValueError("precision='bf16' builds ZeRO's MixedPrecision: do not also pass mixed_precision")
            keywords["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                                         output_dtype=output_dtype)
        return ZeRO(model, stage=stage, process_group=process_group, **keywords)
    return wrap


def _policy_wrapper(name: str, module: str, wrapper: str, policy: str) -> Callable[..., nn.Module]:
    """``wrap`` for strategy ``name``'s wrapper taking one options policy (``module:wrapper``, its policy class
    ``policy``), or its fields as keywords."""
    def wrap(model: nn.Module, process_group=None, options: Any = None, precision: str = "fp32",
             output_dtype: torch.dtype | None = None) -> nn.Module:
        import importlib

        package = importlib.import_module(module)
        if isinstance(options, getattr(package, policy)):
            return getattr(package, wrapper)(model, options, process_group=process_group)
        keywords = _keywords(options, name, f"a {policy} or a dict of {wrapper}'s keyword arguments")
        return getattr(package, wrapper)(model, process_group=process_group, **keywords)
    return wrap


def _localsgd_options(cfg, model: nn.Module, nodes: int) -> Any:
    from dptrain.localsgd import LocalSGDOptions

    return LocalSGDOptions.from_section(cfg.localsgd, ddp=ddp_options(cfg, model, nodes))


def _diloco_options(cfg, model: nn.Module, nodes: int) -> Any:
    from dptrain.diloco import DiLoCoOptions

    return DiLoCoOptions.from_section(cfg.diloco, ddp=ddp_options(cfg, model, nodes))


def _localsgd_schedule(cfg, model: nn.Module) -> SyncSchedule:
    """Every ``localsgd.period`` steps an all-reduce of the whole model, in its parameters' dtype."""
    params = [p for p in model.parameters() if p.requires_grad]
    size = params[0].element_size() if params else 4
    return SyncSchedule(cfg.localsgd.period, (sum(p.numel() for p in params),), 0,
                        lambda n: n * size, cfg.localsgd.warmup_steps, "average")


def _diloco_schedule(cfg, model: nn.Module) -> SyncSchedule:
    """Every H / P steps one fragment's fp32 pseudo-gradient reduced, in turn, through ``diloco.compression``'s codec,
    beside ``diloco.overlap_steps`` inner steps (:func:`dptrain.diloco.sync_schedule`)."""
    from dptrain.diloco import sync_schedule

    every, parts, overlap, wire_bytes = sync_schedule(cfg.diloco, model)
    return SyncSchedule(every, parts, overlap, wire_bytes, cfg.diloco.warmup_steps,
                        "outer step" if len(parts) == 1 else "fragment outer step")


def _zero(stage: int, summary: str) -> Strategy:
    return Strategy(f"zero{stage}", summary, zero_stage=stage, shards_parameters=True, replicated_state=stage < 3,
                    checkpoint_layout="sharded", casts_itself=True, codecs=ZERO_CODECS, buckets=stage < 3,
                    options_argument="zero_kwargs", label=f"ZeRO-{stage}", wrap=_zero_wrapper(stage),
                    options=lambda cfg, model, nodes: zero_options(cfg, model, nodes, stage), check=zero_check,
                    compression=zero_compression, units=zero_units(stage), check_shards=zero_check_shards,
                    check_model=zero_check_model, live="step", check_live=zero_check_live,
                    live_group=lambda cfg: cfg.zero.shard_size)


REGISTRY: dict[str, Strategy] = {s.name: s for s in [
    Strategy("ddp", "replicated model, gradients all-reduced in buckets (the DDP engine)", zero_stage=0,
             shards_parameters=False, replicated_state=True, checkpoint_layout="replicated", codecs=CODECS,
             dynamic_batching=True, comm_hooks=True, optimizer_in_backward=True, options_argument="ddp_kwargs",
             live="step", label="DDP", wrap=_keywords_wrapper("ddp", "dptrain.ddp", "DistributedDataParallel"),
             options=ddp_options, compression=ddp_compression, units=ddp_units),
    _zero(1, "ZeRO-1: optimizer state sharded"),
    _zero(2, "ZeRO-2: optimizer state and gradients sharded"),
    _zero(3, "ZeRO-3: optimizer state, gradients and parameters sharded (FSDP)"),
    Strategy("gossip", "decentralized SGD: parameters mixed with neighbours, no global all-reduce (D-PSGD)",
             zero_stage=None, shards_parameters=False, replicated_state=False, checkpoint_layout="replicated",
             uncompressed="has none (it exchanges parameters with neighbours, not gradients)", buckets=False,
             options_argument="gossip_kwargs",
             wrap=_keywords_wrapper("gossip", "dptrain.gossip.module", "GossipDataParallel"), options=gossip_options),
    Strategy("ps", "parameter server: workers push gradients to server ranks and pull parameters (sync, async, "
             "SSP, backup workers)", zero_stage=None, shards_parameters=False, replicated_state=False,
             checkpoint_layout="ps", uncompressed="sends fp32 gradients to its servers", own_loop=True, buckets=False,
             roles=("workers", "server rank(s)"), check=ps_check, check_model=ps_check_model,
             check_resume=ps_check_resume, expendable=ps_expendable, program=ps_program),
    Strategy("localsgd", "post-local SGD: the DDP engine for a warm-up, then local steps with the models averaged "
             "every H steps (Lin et al. 2020)", zero_stage=None, shards_parameters=False, replicated_state=False,
             checkpoint_layout="replicated", uncompressed="averages the models uncompressed, every localsgd.period "
             "steps", wrap=_policy_wrapper("localsgd", "dptrain.localsgd", "LocalSGD", "LocalSGDOptions"),
             options=_localsgd_options, live="meeting", sync_schedule=_localsgd_schedule),
    Strategy("diloco", "DiLoCo: H local steps of the run's optimizer, then an outer Nesterov step on the averaged "
             "pseudo-gradients (Douillard et al. 2023)", zero_stage=None, shards_parameters=False,
             replicated_state=False, checkpoint_layout="replicated", uncompressed="compresses its outer step's "
             "all-reduce itself (diloco.compression)",
             wrap=_policy_wrapper("diloco", "dptrain.diloco", "DiLoCo", "DiLoCoOptions"), options=_diloco_options,
             live="meeting", sync_schedule=_diloco_schedule),
]}


def strategy_names(where: Callable[[Strategy], bool] = lambda s: True) -> tuple[str, ...]:
    """The registered names whose entry satisfies ``where``, in registration order."""
    return tuple(name for name, s in REGISTRY.items() if where(s))


def get_strategy(name: str, among: tuple[str, ...] | None = None) -> Strategy:
    """The entry for ``name``; an unknown name (or one outside ``among``) is a ValueError with a did-you-mean."""
    choices = among if among is not None else tuple(REGISTRY)
    if name in choices:
        return REGISTRY[name]
    raise ValueError(f"unknown strategy {name!r}{did_you_mean(name, choices)}; choose one of {', '.join(choices)}")


def did_you_mean(name: str, choices: tuple[str, ...]) -> str:
    """`` (did you mean 'zero3'?)`` for the choice closest to ``name``, case ignored (``DDP``, ``ZeRO-3``), or ''."""
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(str(name).lower(), list(lowered), n=1)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def checkpoint_writers() -> dict[str, tuple[str, ...]]:
    """Each checkpoint layout and the strategies that write it, for the checkpoint layer's messages (it sits below
    the registry and knows no strategy's name: its caller passes this down)."""
    return {layout: strategy_names(lambda s, layout=layout: s.checkpoint_layout == layout)
            for layout in dict.fromkeys(s.checkpoint_layout for s in REGISTRY.values())}
