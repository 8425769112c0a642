"""The worker's training run: what ``dptrain run`` executes on every rank, one loop for every way of keeping the job
together.

The order of things, nanoGPT's, in :func:`_train`:

1. join the run directory, build the task's model from the seed (the same on every rank; the
   wrapper broadcasts rank 0's copy anyway), the :class:`Engine` with its strategy's wrapper
   (:mod:`dptrain.runner.build`, through the registry);
2. start, as the step gate says (:mod:`dptrain.runner.gate`): resume from the newest checkpoint
   if there is one (model, optimizer, loss scaler, step, this rank's RNG states, the data
   position), else seed; under live recovery a worker that joins a job under way is healed by
   a peer instead (:mod:`dptrain.runner.live_gate`);
3. for each turn the gate grants: the micro-steps of forward and backward (:func:`timed_backward`,
   gradients synchronised on the last), then, if the gate commits (always, but under live recovery's
   vote), the optimizer's step (clip, learning rate, step), between the step hooks' moments
   (:mod:`dptrain.runner.hooks`: heartbeat, faults, straggler, skipped steps, dynamic batching,
   trace, divergence, metrics, evaluation, checkpoints, each configured from the config);
4. at the end: the final weights as safetensors, and on rank 0 the run's facts, returned.

The loop draws nothing: its caller (``dptrain.run``) makes the plots, ``summary.json`` and
``report.html`` from the run directory's files (:mod:`dptrain.pages.finish`). A strategy with a
program of its own (the parameter server: see :mod:`dptrain.ps.program` for why) runs instead,
with the same lifecycle (:mod:`dptrain.runner.lifecycle`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from dptrain.api.engine import Engine, StepInfo
from dptrain.checkpoint.resume import seed_everything
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv
from dptrain.runner.build import build_engine, lr_rule, peak_lr
from dptrain.runner.facts import RunFacts
from dptrain.runner.gate import StaticGate
from dptrain.runner.hooks import RunContext
from dptrain.runner.hooks.build import build_hooks
from dptrain.runner.lifecycle import base_facts, open_run_dir, open_sink, program_context
from dptrain.runner.live_gate import LiveGate
from dptrain.runner.live_meetings import MeetingGate
from dptrain.runner.metrics import StepTimes
from dptrain.runner.outputs import evaluate, save_hf_model
from dptrain.runner.plan import RunPlan
from dptrain.runner.report import RunLog
from dptrain.strategies import get_strategy
from dptrain.tasks import Task

__all__ = ["train", "timed_step", "timed_backward", "evaluate"]

WATCHDOG_MARGIN_S = 3.0  # the watchdog's wait beyond distributed.timeout_s and the roll call


def train(rp: RunPlan, env: WorkerEnv, device: torch.device) -> RunFacts | None:
    """Run the training described by ``rp`` on this rank; rank 0 returns the run's facts (the summary's input).

    A heartbeat thread (``launch.heartbeat``) beats throughout; the loop's progress marks arm its
    watchdog, which ends this rank when it makes no progress for ``distributed.timeout_s`` + the roll call's
    wait + ``WATCHDOG_MARGIN_S`` (the collective's timeout and the roll call speak first).
    """
    margin = rp.cfg.distributed.roll_call_s + WATCHDOG_MARGIN_S
    entry = get_strategy(rp.cfg.distributed.strategy)
    with Heartbeat(rp.run_dir, env.rank, env.world_size, rp.cfg.distributed.timeout_s, margin) as beat:
        open_run_dir(rp, env.rank)
        if entry.own_loop:  # its ranks run programs of their own (the parameter server's servers and workers)
            return entry.program(program_context(rp, env, device, beat))
        gate = StaticGate if not rp.cfg.live.enabled else MeetingGate if entry.live == "meeting" else LiveGate
        with gate.guard(rp):
            return _train(rp, env, device, beat, gate)


def _train(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat, gate_type: type[StaticGate]) \
        -> RunFacts | None:
    """Build, start (resume, seed or join), step between the hooks as the gate grants, save the weights."""
    wall0 = time.perf_counter()
    prepared = gate_type.prepare(rp, env)  # live recovery's shard group, made before the model is sharded over it
    seed_everything(rp.cfg.train.seed)
    engine, compression, n_params = build_engine(rp, env, device)
    gate = gate_type(rp, env, engine, compression, beat, prepared)
    start = gate.start()
    log = _open_log(rp, env, device, n_params, start.step, start.note)
    for line in start.lines:
        log.info(line)
    if start.over:
        log.info(start.over)
        gate.stop()
        log.close()
        return None
    sink = open_sink(rp, env.rank, start.records_from, log) if gate.outputs else None
    run = RunContext(rp, env, device, engine, log, beat, sink, compression, start.step, n_params,
                     checkpoint_meta=gate.checkpoint_meta, parts=gate.parts)
    hooks = build_hooks(run, gate)
    step = start.step
    try:
        for turn in gate.turns(log.info):
            step = turn.step
            times = info = None
            with contextlib.ExitStack() as measuring:
                if turn.batches is not None:
                    hooks.begin_step(step)
                    measuring.enter_context(hooks.measuring(step))
                    times = timed_backward(engine, rp.task, turn.batches, weighted=turn.weighted,
                                           after_first_forward=hooks.first_forward)
                committed = gate.decide(turn, times)
                if committed:
                    info = _optimizer_step(engine, times)
                else:
                    engine.drop_window()
            gate.settle(turn, committed)
            if committed:
                hooks.after_step(step, info, times)
        gate.finish()
        hooks.at_end(rp.cfg.train.steps)
    except Exception as e:
        gate.failed(e, step)
        raise
    finally:
        hooks.close()
        gate.stop()
    facts = gate.done(_save_final_weights(run, wall0) if gate.outputs else None)
    log.close()
    dist.barrier()
    return facts


def timed_step(engine: Engine, task: Task, batches: Iterator[Any], *, weighted: bool = False,
               after_first_forward: Callable[[], None] | None = None) -> tuple[StepInfo, StepTimes]:
    """One optimizer step (all its micro-steps), with the wall-clock spans of its parts.

    ``weighted``: ``batches`` yields a step's [(micro-batch, loss weight)] at a time (dynamic batching,
    :class:`dptrain.data.balance.DynamicLoader`). ``after_first_forward`` runs inside the step's first
    forward span (an injected straggler's sleep: compute, as a slow device's would be).
    """
    times = timed_backward(engine, task, batches, weighted=weighted, after_first_forward=after_first_forward)
    return _optimizer_step(engine, times), times


def _optimizer_step(engine: Engine, times: StepTimes) -> StepInfo:
    """The step's optimizer part (clip, learning rate, step, zero), timed into ``times``."""
    o0 = time.perf_counter()
    info = engine.step()
    times.end = time.perf_counter()
    times.optimizer = (o0, times.end)
    return info


def timed_backward(engine: Engine, task: Task, batches: Iterator[Any], *, weighted: bool = False,
                   after_first_forward: Callable[[], None] | None = None) -> StepTimes:
    """A step's micro-steps of forward and backward (the gradients synchronised in the last), timed; no optimizer
    step (:func:`timed_step` takes it; the loop takes it once the gate commits)."""
    times = StepTimes(start=time.perf_counter())
    step = next(batches) if weighted else None  # a step's [(micro-batch, loss weight)], as many as it takes
    for item in engine.micro_steps(iter(step) if weighted else batches, len(step) if weighted else None):
        batch, weight = item if weighted else (item, None)
        f0 = time.perf_counter()
        with engine.autocast():
            loss = task.loss(engine.model, batch)
        if after_first_forward is not None and not times.forward:
            after_first_forward()
        f1 = time.perf_counter()
        engine.backward(loss, weight)
        times.forward.append((f0, f1))
        times.backward.append((f1, time.perf_counter()))
    times.comm = engine.model.last_step_comm  # the wrapper protocol's: DDP's buckets, ZeRO's collectives (gossip: None)
    return times


def _open_log(rp: RunPlan, env: WorkerEnv, device: torch.device, n_params: int, start_step: int,
              resume_note: str | None) -> RunLog:
    """This rank's log, opened with what the run is: task, ranks, batch, learning rate, where it resumed."""
    plan, t = rp.plan, rp.cfg.train
    log = RunLog(rp.run_dir / "logs" / f"rank{env.rank}.log", env.rank, rp.cfg.log.progress, t.steps, start_step)
    log.info(f"dptrain run: task {rp.task.name}, {n_params:,} parameters, {env.world_size} rank(s) on {device} "
             f"({dist.get_backend()}), global batch {plan.global_batch_size} = micro {plan.micro_batch_size} x "
             f"{env.world_size} ranks x {plan.grad_accum_steps} accum")
    log.info(f"learning rate: {lr_rule(rp)}")
    log.info(f"run directory: {rp.run_dir}")
    if start_step:
        log.info(f"resumed from {rp.resume_from} at step {start_step}")
    if resume_note:
        log.info(resume_note)
    if start_step >= t.steps:
        log.info(f"nothing to do: the checkpoint is at step {start_step} and train.steps is {t.steps}")
    return log


def _save_final_weights(run: RunContext, wall0: float) -> RunFacts | None:
    """model.safetensors (the wrapper's export: collective when sharded, every rank's shards gathered to rank 0)
    and the Hugging Face export; rank 0 returns the run's facts."""
    run.engine.model.export_weights(run.rp.run_dir / "model.safetensors")
    if run.env.rank != 0:
        return None
    save_hf_model(run.rp.cfg, run.rp.run_dir, run.log)
    return _facts(run, time.perf_counter() - wall0)


def _facts(run: RunContext, wall_s: float) -> RunFacts:
    """What the run was, for the summary (:func:`dptrain.runner.report.summarize`)."""
    return base_facts(run.rp, run.env, run.device, run.parameters, run.start_step, wall_s, lr_rule(run.rp),
                      peak_lr(run.rp))
