"""The numbers behind ``dptrain explore``: the planner's and the cost model's, computed over the page's grid.

The page computes nothing of its own that could drift from dptrain's models:

- **Memory** (the planner, :func:`~dptrain.planner.plan.plan_row`): for every model,
  strategy (the registry's planned ones: DDP, ZeRO-1/2/3 today; and HSDP, the one that
  shards the most with one shard group per host of 8), precision,
  optimizer, micro-batch and DP degree on the grid, rank 0's parameters, gradients,
  optimizer state, buffers and communication buffers, and the activations (with and
  without checkpointing) of each way the forward computes. The page adds them up as
  :meth:`~dptrain.planner.plan.Row.total` does.
- **Scaling** (the simulator, :func:`~dptrain.planner.simulate.simulate_step`, DDP):
  each bucket's size and the fraction of backward after which it is ready (the FLOPs
  profile's rule), the FLOPs of one sample, and each bucket all-reduce's cost split
  into what the α-β-γ model multiplies: rounds, bytes on the critical path (full and
  half duplex) and bytes reduced. The page replays the simulator's DDP timeline with
  any link's α, β and γ, so a preset and a link typed by hand are both exact.
- **All-reduce** (:func:`~dptrain.comm.cost.collective_cost`): the same split for ring,
  tree, naive and hierarchical (8 ranks per host) over message sizes and world sizes,
  with each algorithm's rounds and bytes sent per rank.
- **Devices**: the planner's device presets and default headroom
  (:mod:`~dptrain.planner.devices`), so a total fits on the page as in ``dptrain plan``.

The tests compare the page's arithmetic on these numbers with the Python functions at
grid points (tests/test_explore.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dptrain.comm.cost import collective_cost
from dptrain.config import ConfigError, RunConfig
from dptrain.planner.devices import DEFAULT_HEADROOM, DEVICES
from dptrain.planner.from_config import checkpoint_classes, compute_mode, optimizer_for, setup_for, trace_model
from dptrain.planner.layout import Setup, units
from dptrain.planner.network import PRESETS
from dptrain.planner.plan import plan_row
from dptrain.planner.simulate import flops_profile
from dptrain.strategies import get_strategy, strategy_names

__all__ = ["Target", "PRESET_MODELS", "preset_target", "config_target", "DP_DEGREES", "explore_data",
           "setup_of", "optimizer_config"]

DP_DEGREES = tuple(2 ** k for k in range(11))  # 1 .. 1024
PLANNED = strategy_names(lambda s: s.planned)  # the registry's strategies the planner models
# the DDP engine: the planned strategy that neither shards nor gives up buckets, whose timeline the scaling panel
# replays and whose traffic the memory readout compares with
BASELINE = next(n for n in PLANNED if not get_strategy(n).shards_parameters and get_strategy(n).buckets)
HSDP_SHARD = 8  # one shard group per host of 8 devices
# the page's hybrid strategies, a registry strategy and its shard group: HSDP is the one that shards the most
HYBRID = {"hsdp": (max((n for n in PLANNED if get_strategy(n).shards_parameters),
                       key=lambda n: get_strategy(n).zero_stage), HSDP_SHARD)}
STRATEGIES = (*PLANNED, *HYBRID)
LABELS = {**{n: get_strategy(n).label or n for n in PLANNED}, **{h: h.upper() for h in HYBRID}}  # as people write them
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")
MICRO_BATCHES = (1, 2, 4, 8)
BUCKET_CAPS = (0.0, 1.0, 5.0, 25.0, 100.0)  # MiB; 0: one bucket per parameter (no bucketing)
COMPRESSION = (1, 2, 4, 16, 64)
MESSAGE_SIZES = tuple(1024 * 4 ** k for k in range(11))  # 1 KiB .. 1 GiB
ALGORITHMS = ("ring", "tree", "naive", "hierarchical")
PER_NODE = 8  # ranks per host for the hierarchical all-reduce

# name: (label, GPT arguments, sequence length). dptrain's GPT (GELU MLP, tied embeddings): the 7B and 70B
# classes have Llama-like widths and depths, not Llama's exact layers, and their exact counts are shown.
PRESET_MODELS: dict[str, tuple[str, dict, int]] = {
    "gpt2-124m": ("GPT-2 small", dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768), 1024),
    "gpt2-355m": ("GPT-2 medium", dict(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024), 1024),
    "gpt2-774m": ("GPT-2 large", dict(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280), 1024),
    "gpt2-1.5b": ("GPT-2 XL", dict(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600), 1024),
    "7b": ("7B class (32 x 4096)", dict(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096), 4096),
    "70b": ("70B class (80 x 8192)", dict(vocab_size=32000, block_size=4096, n_layer=80, n_head=64, n_embd=8192),
            4096),
}


@dataclass
class Target:
    """A model to explore: how to build it (under a fake tensor mode), a batch of ``n`` samples, its loss."""

    name: str
    label: str
    cfg: RunConfig  # the engine options setup_for reads (the run's own, or the defaults for a preset)
    build: Callable[[], nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    tokens_per_sample: int
    note: str = ""


def _lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def preset_target(name: str, cfg: RunConfig | None = None) -> Target:
    """One of :data:`PRESET_MODELS`: dptrain's built-in GPT at that size, with ``dptrain run``'s engine defaults."""
    from dptrain.models.gpt import GPT

    if name not in PRESET_MODELS:
        raise ConfigError(f"unknown model preset {name!r}; choose from config, {', '.join(PRESET_MODELS)}")
    label, kwargs, seq = PRESET_MODELS[name]

    def batch(n: int):
        x = torch.zeros(n, seq, dtype=torch.long)
        return x, x

    return Target(name, label, cfg or RunConfig(), lambda: GPT(**kwargs), batch, _lm_loss, seq,
                  f"dptrain's GPT: {kwargs['n_layer']} layers of width {kwargs['n_embd']}, {kwargs['n_head']} heads, "
                  f"vocabulary {kwargs['vocab_size']}, {seq} tokens per sample")


def config_target(cfg: RunConfig, label: str = "this config's model") -> Target:
    """The model ``dptrain run`` would train for ``cfg``, with its engine options."""
    from dptrain.planner.target import plan_task
    from dptrain.tasks import architecture, collate

    task = plan_task(cfg)  # a Hugging Face model needs no data: samples of its block size
    sample = task.train_set[0]
    first = sample[0] if isinstance(sample, (tuple, list)) else sample
    tokens = int(first.numel()) if torch.is_tensor(first) and first.dtype == torch.long else 1

    def batch(n: int):
        return collate(task)([task.train_set[i % len(task.train_set)] for i in range(n)])

    return Target("config", label, cfg, lambda: architecture(task), batch, task.loss, tokens,
                  f"task {task.name}")


def optimizer_config(cfg: RunConfig, optimizer: str) -> RunConfig:
    """``cfg`` with ``train.optimizer`` set (SGD with momentum 0.9 where the config has none)."""
    t = cfg.train
    momentum = t.momentum if t.momentum else 0.9
    return dataclasses.replace(cfg, train=dataclasses.replace(t, optimizer=optimizer, momentum=momentum))


def setup_of(target: Target, model: nn.Module, strategy: str, world_size: int, precision: str) -> Setup | None:
    """The planner's :class:`Setup` for a page strategy (``hsdp``: ZeRO-3 sharded over hosts of
    :data:`HSDP_SHARD`), or None where it does not exist (HSDP on one host)."""
    base, shard_size = HYBRID.get(strategy, (strategy, None))
    if shard_size is None:
        return setup_for(target.cfg, model, strategy, world_size, precision)
    if world_size <= shard_size:
        return None
    zero = dataclasses.replace(target.cfg.zero, shard_size=shard_size)
    return setup_for(dataclasses.replace(target.cfg, zero=zero), model, base, world_size, precision)


# ------------------------------------------------------------------------------- memory


def _memory(target: Target, model: nn.Module, mode: FakeTensorMode, dp: tuple[int, ...],
            micro_batches: tuple[int, ...], notes: list[str]) -> dict:
    checkpoint = checkpoint_classes(target.cfg, model)
    activations: dict[str, dict[str, list[int | None]]] = {}
    built: dict[torch.dtype, nn.Module] = {model.parameters().__next__().dtype: model}

    def build() -> nn.Module:  # one model per parameter dtype (trace_model builds under the default dtype)
        dtype = torch.get_default_dtype()
        if dtype not in built:
            built[dtype] = target.build()
        return built[dtype]

    for mb in micro_batches:
        for compute in ("fp32", "autocast", "bf16"):
            acts = trace_model(build, lambda mb=mb: target.batch(mb), target.loss, compute, checkpoint, mode, notes,
                               f"{target.name}, micro-batch {mb}")
            activations.setdefault(str(mb), {})[compute] = \
                [acts.saved, acts.checkpointed] if acts is not None else [None, None]
    states: dict[str, Any] = {}
    shapes: dict[str, list] = {}  # a strategy's units do not depend on the world size or the precision
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            for opt in OPTIMIZERS:
                cfg = optimizer_config(target.cfg, opt)
                cells = []
                for n in dp:
                    setup = setup_of(target, model, strategy, n, precision)
                    if setup is None:
                        cells.append(None)
                        continue
                    if shapes.get(strategy) is None:  # a strategy's units are the same at every DP degree
                        shapes[strategy] = units(model, setup)
                    row = plan_row(model, setup, None, optimizer=lambda params, cfg=cfg: optimizer_for(cfg, params),
                                   shapes=shapes[strategy])
                    s = row.states
                    cells.append([s.parameters, s.gradients, s.optimizer, s.buffers, row.comm_buffers,
                                  row.traffic.total])
                states.setdefault(strategy, {}).setdefault(precision, {})[opt] = cells
    return {"activations": activations, "states": states,
            "compute": {f"{s}/{p}": compute_mode(HYBRID.get(s, (s,))[0], p) for s in STRATEGIES
                        for p in PRECISIONS}}


# ------------------------------------------------------------------------------ scaling


def _coefficients(cost) -> list[float]:
    """What the α-β-γ model multiplies, summed over the rounds: [rounds, bytes (full duplex), bytes (half
    duplex), bytes reduced], per tier (flat algorithms: all on "net")."""
    out = []
    for tier in ("node", "net"):
        rounds = [r for r in cost.rounds if r.tier == tier]
        out += [len(rounds), sum(r.nbytes for r in rounds), sum(r.moved for r in rounds),
                sum(r.reduced for r in rounds)]
    return out


def _scaling(target: Target, model: nn.Module, mode: FakeTensorMode, dp: tuple[int, ...], costs: dict) -> dict:
    with mode:
        batch = torch.utils._pytree.tree_map(lambda x: mode.from_tensor(x) if torch.is_tensor(x) else x,
                                             target.batch(1))
        flops = flops_profile(model, batch, target.loss, 1.0)  # one sample's FLOPs: forward_s at 1 FLOP/s
    buckets: dict[str, list[list]] = {}
    for cap in BUCKET_CAPS:
        setup = Setup(BASELINE, 1, "fp32", bucket_cap_mb=cap if cap else 1e-9)  # 1 byte: a bucket per parameter
        shown = []
        for unit in units(model, setup):
            ready = max((flops.ready.get(name, 1.0) for name in unit.names), default=1.0)
            shown.append([unit.numel, ready])
            for ratio in COMPRESSION:
                numel = -(-unit.numel // ratio)
                key = f"{numel}:{unit.dtype.itemsize}"
                if key not in costs:
                    costs[key] = [_coefficients(collective_cost("all_reduce", "ring", numel, unit.dtype.itemsize, n))
                                  for n in dp]
        buckets[f"{cap:g}"] = shown
    return {"flops_per_sample": flops.forward_s, "itemsize": 4, "buckets": buckets}


def _all_reduce_table(dp: tuple[int, ...]) -> dict:
    table: dict[str, Any] = {}
    for algorithm in ALGORITHMS:
        rows = []
        for size in MESSAGE_SIZES:
            cells = []
            for n in dp:
                if n == 1:
                    cells.append(None)
                    continue
                cost = collective_cost("all_reduce", algorithm, size // 4, 4, n,
                                       nodes=min(PER_NODE, n) if algorithm == "hierarchical" else None)
                cells.append([len(cost.rounds), max(cost.bytes_sent), *_coefficients(cost)])
            rows.append(cells)
        table[algorithm] = rows
    return {"sizes": list(MESSAGE_SIZES), "per_node": PER_NODE, "cells": table}


def _networks() -> dict:
    def link(lk) -> dict:
        return {"alpha": lk.alpha, "beta": lk.beta, "gamma": lk.gamma, "duplex": lk.duplex}

    return {name: {"node": link(n.node), "net": link(n.net), "per_node": min(n.per_node, 1 << 20),
                   "source": n.source} for name, n in PRESETS.items()}


# --------------------------------------------------------------------------------- all


def explore_data(targets: list[Target], dp: tuple[int, ...] = DP_DEGREES,
                 micro_batches: tuple[int, ...] = MICRO_BATCHES, progress: Callable[[str], None] = lambda s: None
                 ) -> dict:
    """Everything the page shows, for ``targets`` over the grid (JSON-ready)."""
    if dp[0] != 1:
        raise ValueError(f"the DP degrees must start at 1 (the scaling baseline), got {dp}")
    models, notes, costs = [], [], {}
    for target in targets:
        progress(f"{target.name}: building on fake tensors, tracing, planning {len(dp)} DP degrees")
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        try:
            with mode:
                model = target.build()
        except Exception as e:  # the user's factory may fail in any way
            raise ConfigError(f"building {target.label} to explore failed: {type(e).__name__}: {e}") from None
        count = sum(p.numel() for p in model.parameters())
        models.append({"name": target.name, "label": target.label, "params": count, "note": target.note,
                       "tokens_per_sample": target.tokens_per_sample,
                       "memory": _memory(target, model, mode, dp, micro_batches, notes),
                       "scaling": _scaling(target, model, mode, dp, costs)})
    progress("all-reduce costs")
    return {"dp": list(dp), "strategies": list(STRATEGIES), "labels": LABELS, "baseline": BASELINE,
            "first": next(n for n in PLANNED if get_strategy(n).shards_parameters),  # the page opens on it
            "hybrid": {name: {"of": base, "shard": shard} for name, (base, shard) in HYBRID.items()},
            "precisions": list(PRECISIONS), "optimizers": list(OPTIMIZERS), "micro_batches": list(micro_batches),
            "bucket_caps": list(BUCKET_CAPS), "compression": list(COMPRESSION), "models": models,
            "costs": costs, "networks": _networks(), "all_reduce": _all_reduce_table(dp), "notes": notes,
            "devices": [{"name": d.name, "label": d.label, "bytes": d.bytes} for d in DEVICES.values()],
            "headroom": DEFAULT_HEADROOM}
