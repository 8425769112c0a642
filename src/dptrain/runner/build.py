"""What a run trains, built from its config: the model, the optimizer, the :class:`Engine` (its
strategy's wrapper, looked up in the registry), the gradient compression, the batches.

The learning rate follows the warmup-cosine schedule from a peak scaled to the global batch
(:mod:`dptrain.optim.schedule`); a strategy's options come from its registry entry
(:mod:`dptrain.strategies.options`), so a setting means here what it means to the planner.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dptrain.api.engine import Engine
from dptrain.data.balance import DynamicBatcher, DynamicLoader
from dptrain.data.loader import steps_per_epoch
from dptrain.launch.rendezvous import WorkerEnv
from dptrain.optim.build import build_optimizer
from dptrain.optim.onebit_freeze import onebit_freeze
from dptrain.optim.schedule import scaled_lr, warmup_cosine
from dptrain.runner.plan import RunPlan
from dptrain.strategies import Strategy, get_strategy
from dptrain.tasks import collate

__all__ = ["peak_lr", "lr_rule", "build_engine", "build_batches"]


def peak_lr(rp: RunPlan) -> float:
    """``train.lr`` scaled from ``train.base_batch_size`` to the run's global batch (``train.lr_scaling``)."""
    t = rp.cfg.train
    return scaled_lr(t.lr, t.lr_scaling, rp.plan.global_batch_size, t.base_batch_size)


def lr_rule(rp: RunPlan) -> str:
    """The schedule in words, for the log and the summary."""
    t = rp.cfg.train
    return (f"peak {peak_lr(rp):.3g} = {t.lr:g} x {t.lr_scaling} scaling for global batch "
            f"{rp.plan.global_batch_size} (base {t.base_batch_size}); warmup {t.warmup_steps} steps, "
            f"cosine to {t.min_lr_ratio:g} x peak")


def build_engine(rp: RunPlan, env: WorkerEnv, device: torch.device) -> tuple[Engine, Any, int]:
    """The task's model wrapped by the run's strategy, its optimizer and schedule; the compression, if any (what
    keeps the residuals a checkpoint saves); and the model's parameter count (before a strategy shards them)."""
    cfg, t = rp.cfg, rp.cfg.train
    strategy = get_strategy(cfg.distributed.strategy)
    model = rp.task.build_model().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    options = strategy.options(cfg, model, cfg.ddp.ranks_per_node or env.local_world_size)
    peak = peak_lr(rp)
    # under momentum correction the ranks keep the momentum (dptrain.compress.dgc): the optimizer has none
    momentum = 0.0 if cfg.compression.momentum_correction else t.momentum
    engine = Engine(model, lambda wrapped: build_optimizer(wrapped, t.optimizer, peak, t.weight_decay,
                                                           tuple(t.betas), momentum, *onebit_freeze(cfg)),
                    rp.plan, precision=t.precision, grad_clip=t.grad_clip,
                    lr_at=lambda s: warmup_cosine(s, peak, t.warmup_steps, t.steps, t.min_lr_ratio),
                    strategy=strategy.name, options=options)
    engine.model.record_comm_spans(True)  # each collective's launch and completion: the trace, the overlap figures
    if cfg.ddp.optimizer_in_backward:  # each bucket stepped as its all-reduce completes (validate.py checked it)
        engine.optimizer_in_backward()
    return engine, _compression(cfg, strategy, engine), n_params


def _compression(cfg, strategy: Strategy, engine: Engine) -> Any:
    """What compresses the run's reductions, and keeps the residuals a checkpoint saves: 1-bit Adam's own (its
    momentum's 1-bit all-reduce), or ``compression.method`` as the strategy applies it (None: uncompressed)."""
    own = getattr(engine.optimizer, "compressor", None)
    if own is not None:
        return own
    return strategy.compression(cfg, engine.model) if strategy.compression is not None else None


def build_batches(rp: RunPlan, rank: int, engine: Engine, start_step: int) -> tuple[Iterator, DynamicBatcher | None]:
    """This rank's batches from ``start_step`` on; with dynamic batching, each step's [(micro-batch, loss weight)]
    at a time, with the batcher that divides the global batch (:mod:`dptrain.data.balance`)."""
    cfg, plan, task = rp.cfg, rp.plan, rp.task
    if not cfg.balance.dynamic_batching:
        loader = engine.loader(task.train_set, seed=cfg.train.seed, collate_fn=collate(task))
        return loader.micro_batches(start_step), None
    batcher = DynamicBatcher(plan.global_batch_size, plan.world_size, rank, plan.grad_accum_steps,
                             cfg.balance.every, cfg.balance.smoothing)
    loader = DynamicLoader(task.train_set, batcher, steps_per_epoch(len(task.train_set), plan),
                           seed=cfg.train.seed, collate_fn=collate(task))
    return loader.steps(start_step), batcher

