"""The step hooks a run's config asks for, in the order they run (:mod:`dptrain.runner.hooks`).

The order is the same on every rank, and it matters: the heartbeat marks a step before a
fault can stop it; compression's bytes are in a step's times before the metrics read them;
the skipped-steps bound and the divergence check can end a run before its record is
written; evaluation and checkpoints come last, on the step's final state.
"""

from __future__ import annotations

from dptrain.api.engine import Engine
from dptrain.data.balance import DynamicBatcher
from dptrain.runner.divergence import DivergenceMonitor, replica_tensors
from dptrain.runner.hooks import Hooks, RunContext, StepHook
from dptrain.runner.hooks.checkpoint import EvalCheckpointHook
from dptrain.runner.hooks.guard import DivergenceHook, FaultHook, HeartbeatHook, SkipHook, StragglerHook
from dptrain.runner.hooks.metrics import BatchingHook, CompressionStepHook, MetricsHook, TraceHook, strategy_record
from dptrain.runner.lifecycle import run_fault
from dptrain.runner.straggler import Straggler

__all__ = ["build_hooks"]


def build_hooks(run: RunContext, batcher: DynamicBatcher | None) -> Hooks:
    """``run``'s hooks from its config; ``batcher``: dynamic batching's, which also makes the batches."""
    cfg, rank, engine = run.rp.cfg, run.env.rank, run.engine
    fault = run_fault()
    batching = BatchingHook(batcher) if batcher is not None else None
    extras = [batching.record if batching else None, strategy_record(engine)]
    hooks: list[StepHook | None] = [
        HeartbeatHook(run.beat),
        FaultHook(fault, rank, engine.model) if fault else None,
        CompressionStepHook(run.compression) if run.compression is not None else None,
        StragglerHook(Straggler(cfg.straggler.factor)) if cfg.straggler.rank == rank else None,
        SkipHook(cfg.train.max_skipped_steps, engine, run.start_step),
        batching,
        TraceHook.from_config(run),  # collective: the ranks agree on the trace's time zero
        DivergenceHook(_divergence_monitor(cfg, engine), cfg.divergence.every, run.log)
        if cfg.divergence.every else None,
        MetricsHook.from_config(run, [e for e in extras if e is not None]),
        EvalCheckpointHook(run),
    ]
    return Hooks([h for h in hooks if h is not None])


def _divergence_monitor(cfg, engine: Engine) -> DivergenceMonitor:
    """The replica check of ``[divergence]``: parameters and buffers, and the optimizer state where replicated."""
    module = engine.model.module if hasattr(engine.model, "module") else engine.model
    optimizer = None if engine.sharded else engine.optimizer
    return DivergenceMonitor(lambda: replica_tensors(module, optimizer), repair=cfg.divergence.repair)
