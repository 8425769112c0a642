"""The step hooks a run's config asks for, in the order they run (:mod:`dptrain.runner.hooks`).

The order is the same on every rank, and it matters: the heartbeat marks a step before a
fault can stop it; compression's bytes are in a step's times before the metrics read them;
the skipped-steps bound and the divergence check can end a run before its record is
written; evaluation and checkpoints come last, on the step's final state.
"""

from __future__ import annotations

from dptrain.api.engine import Engine
from dptrain.checkpoint.replicated import replica_tensors
from dptrain.runner.divergence import DivergenceMonitor
from dptrain.runner.gate import StaticGate
from dptrain.runner.hooks import Hooks, RunContext, StepHook
from dptrain.runner.hooks.checkpoint import EvalCheckpointHook
from dptrain.runner.hooks.guard import DivergenceHook, FaultHook, HeartbeatHook, SkipHook, StragglerHook
from dptrain.runner.hooks.metrics import BatchingHook, CompressionStepHook, MetricsHook, TraceHook, strategy_record
from dptrain.runner.lifecycle import run_fault
from dptrain.runner.straggler import Straggler

__all__ = ["build_hooks"]


def build_hooks(run: RunContext, gate: StaticGate) -> Hooks:
    """``run``'s hooks from its config, for the step gate that keeps its job together (its dynamic batcher, which
    also makes the batches; whether the ranks share a process group; what it adds to each metrics record)."""
    if gate.replica_local:
        return _replica_hooks(run, gate)
    cfg, rank, engine = run.rp.cfg, run.env.rank, run.engine
    fault = run_fault()
    batching = BatchingHook(gate.batcher) if gate.batcher is not None else None
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


def _replica_hooks(run: RunContext, gate: StaticGate) -> Hooks:
    """The hooks of a worker that is a process group of its own (live recovery): the watchdog's marks, the injected
    fault, the skipped-steps bound on every worker; where it keeps the run's outputs (replica 0) also the trace of its
    own steps (the replicas share no process group to merge theirs in), the metrics with the gate's record,
    evaluation and checkpoints. Nothing that would wait on another rank."""
    fault = run_fault()
    hooks: list[StepHook | None] = [
        HeartbeatHook(run.beat),
        FaultHook(fault, run.env.rank, run.engine.model) if fault else None,
        SkipHook(run.rp.cfg.train.max_skipped_steps, run.engine, run.start_step),
    ]
    if gate.outputs:
        extras = [strategy_record(run.engine)] + ([gate.record] if gate.record is not None else [])
        hooks += [TraceHook.from_config(run),  # "collective" over this worker's own group: no other waits
                  MetricsHook.from_config(run, extras), EvalCheckpointHook(run)]
    return Hooks([h for h in hooks if h is not None])


def _divergence_monitor(cfg, engine: Engine) -> DivergenceMonitor:
    """The replica check of ``[divergence]``: parameters and buffers, and the optimizer state where replicated."""
    module = engine.model.module if hasattr(engine.model, "module") else engine.model
    optimizer = None if engine.sharded else engine.optimizer
    return DivergenceMonitor(lambda: replica_tensors(module, optimizer), repair=cfg.divergence.repair)
