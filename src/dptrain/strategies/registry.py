"""One :class:`Strategy` per name: the facts every layer above needs, and how to wrap a model.

The strategies' own packages (``dptrain.ddp``, ``dptrain.zero``, ``dptrain.gossip.module``,
``dptrain.ps``) implement them; this module describes each once, for the validation of a
run, the user API (``Engine``, ``prepare()``), the job runner, the planner and the pages.
torchtitan's registry is the model: a component is looked up by name in one place and every
caller goes through it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from dptrain.compress.codecs import CODECS  # the DDP engine's compression hook runs each on its buckets
from dptrain.compress.zero import ZERO_CODECS  # ZeRO's reduce-scatter runs these shard by shard
from dptrain.strategies.options import ddp_options, gossip_options, zero_options

__all__ = ["Strategy", "REGISTRY", "get_strategy", "strategy_names", "SHARDED"]

SHARDED = "sharded"  # the subdirectory of a sharded checkpoint that every rank writes into


@dataclass(frozen=True)
class Strategy:
    """What dptrain knows of one data-parallel strategy.

    ``zero_stage``: 0 for replicated DDP, 1-3 for ZeRO, None where the planner's memory
    and traffic model does not apply (gossip, ps). ``shards_parameters``: the wrapper
    replaces the parameters with shards, so an optimizer is built after wrapping and
    checkpoints are sharded. ``replicated_state``: every rank holds the same parameters
    and optimizer state after a step (what the divergence monitor compares).
    ``checkpoint_layout``: ``replicated`` (rank 0 writes model.pt/optimizer.pt),
    ``sharded`` (every rank writes its shards through DCP), ``ps`` (the servers' shards).
    ``codecs``: the values of ``ddp.compression`` it accepts besides ``none``; where there are none,
    ``uncompressed``: why, completing "strategy NAME ...".
    ``own_loop``: the job runner trains it with a loop of its own (the parameter server:
    its workers and servers run different programs, see ``dptrain.runner.ps_loop``).
    ``buckets``: ``ddp.bucket_cap_mb`` applies (DDP's buckets, ZeRO-1/2's units).
    ``dynamic_batching``: ranks may take unequal shares of the global batch.
    ``comm_hooks``: the wrapper takes a communication hook (``register_comm_hook``), which
    1-bit Adam (``dptrain.optim.OneBitAdam``) replaces the gradient all-reduce with.
    ``decentralized``: each rank keeps its own replica, mixed with its neighbours' and never
    made equal by a reduction (gradients stay local): the runner reports the replicas'
    consensus distance, checkpoints every rank's own and averages them at the end.
    ``options_argument``: the keyword of ``Engine`` and ``prepare()`` whose dict carries
    ``wrap``'s options (``ddp_kwargs``, ``zero_kwargs``, ``gossip_kwargs``).
    ``wrap``: ``wrap(model, process_group, **options) -> module`` (None for ``own_loop``), a module
    satisfying :class:`~dptrain.strategies.protocol.DataParallelWrapper`;
    ``options``: ``options(cfg, model, nodes) -> dict``, those keyword arguments from a run's config
    (:mod:`dptrain.strategies.options`).
    """

    name: str
    summary: str
    zero_stage: int | None
    shards_parameters: bool
    replicated_state: bool
    checkpoint_layout: str
    codecs: tuple[str, ...] = ()
    uncompressed: str = ""
    own_loop: bool = False
    buckets: bool = True
    dynamic_batching: bool = False
    comm_hooks: bool = False
    expendable_workers: bool = False
    decentralized: bool = False
    options_argument: str = "ddp_kwargs"
    wrap: Callable[..., nn.Module] | None = None
    options: Callable[..., dict] | None = None

    def accepts_codec(self, codec: str) -> bool:
        return codec == "none" or codec in self.codecs


def _wrap_ddp(model: nn.Module, process_group=None, **options) -> nn.Module:
    from dptrain.ddp import DistributedDataParallel

    return DistributedDataParallel(model, process_group=process_group, **options)


def _zero_wrapper(stage: int) -> Callable[..., nn.Module]:
    def wrap(model: nn.Module, process_group=None, **options) -> nn.Module:
        from dptrain.zero import ZeRO

        return ZeRO(model, stage=stage, process_group=process_group, **options)
    return wrap


def _wrap_gossip(model: nn.Module, process_group=None, **options) -> nn.Module:
    from dptrain.gossip.module import GossipDataParallel

    return GossipDataParallel(model, process_group=process_group, **options)


def _zero(stage: int, summary: str) -> Strategy:
    return Strategy(f"zero{stage}", summary, zero_stage=stage, shards_parameters=True, replicated_state=stage < 3,
                    checkpoint_layout="sharded", codecs=ZERO_CODECS, buckets=stage < 3,
                    options_argument="zero_kwargs",
                    wrap=_zero_wrapper(stage), options=lambda cfg, model, nodes: zero_options(cfg, model, nodes, stage))


REGISTRY: dict[str, Strategy] = {s.name: s for s in [
    Strategy("ddp", "replicated model, gradients all-reduced in buckets (the DDP engine)", zero_stage=0,
             shards_parameters=False, replicated_state=True, checkpoint_layout="replicated", codecs=CODECS,
             dynamic_batching=True, comm_hooks=True, wrap=_wrap_ddp, options=ddp_options),
    _zero(1, "ZeRO-1: optimizer state sharded"),
    _zero(2, "ZeRO-2: optimizer state and gradients sharded"),
    _zero(3, "ZeRO-3: optimizer state, gradients and parameters sharded (FSDP)"),
    Strategy("gossip", "decentralized SGD: parameters mixed with neighbours, no global all-reduce (D-PSGD)",
             zero_stage=None, shards_parameters=False, replicated_state=False, checkpoint_layout="replicated",
             uncompressed="has none (it exchanges parameters with neighbours, not gradients)", buckets=False,
             decentralized=True, options_argument="gossip_kwargs", wrap=_wrap_gossip, options=gossip_options),
    Strategy("ps", "parameter server: workers push gradients to server ranks and pull parameters (sync, async, "
             "SSP, backup workers)", zero_stage=None, shards_parameters=False, replicated_state=False,
             checkpoint_layout="ps", uncompressed="sends fp32 gradients to its servers", own_loop=True, buckets=False,
             expendable_workers=True, options_argument=""),
]}


def strategy_names(where: Callable[[Strategy], bool] = lambda s: True) -> tuple[str, ...]:
    """The registered names whose entry satisfies ``where``, in registration order."""
    return tuple(name for name, s in REGISTRY.items() if where(s))


def get_strategy(name: str, among: tuple[str, ...] | None = None) -> Strategy:
    """The entry for ``name``; an unknown name (or one outside ``among``) is a ValueError with a did-you-mean."""
    choices = among if among is not None else tuple(REGISTRY)
    if name in choices:
        return REGISTRY[name]
    close = difflib.get_close_matches(str(name), choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown strategy {name!r}{hint}; choose one of {', '.join(choices)}")
