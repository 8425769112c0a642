"""The worker's training run: what ``dptrain run`` executes on every rank.

The order of things, nanoGPT's, in :func:`_train`:

1. join the run directory, build the task's model from the seed (the same on every rank; the
   wrapper broadcasts rank 0's copy anyway), the :class:`Engine` with its strategy's wrapper
   (:mod:`dptrain.runner.build`, through the registry);
2. resume from the newest checkpoint if there is one: model, optimizer, loss scaler, step, and
   this rank's RNG states (:mod:`dptrain.checkpoint.resume`); the data position follows from the step;
3. for each optimizer step: :func:`timed_step` (micro-steps of forward and backward, gradient
   sync on the last; clip, learning rate, optimizer step), between the step hooks' moments
   (:mod:`dptrain.runner.hooks`: heartbeat, faults, straggler, skipped steps, dynamic batching,
   trace, divergence, metrics, evaluation, checkpoints, each configured from the config);
4. at the end: the final weights as safetensors, and on rank 0 the run's facts, returned.

The loop draws nothing: its caller (``dptrain.run``) makes the plots, ``summary.json`` and
``report.html`` from the run directory's files (:mod:`dptrain.pages.finish`). A strategy with a
program of its own (the parameter server: see :mod:`dptrain.ps.program` for why) runs instead, with the same lifecycle (:mod:`dptrain.runner.lifecycle`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from dptrain.api.engine import Engine, StepInfo
from dptrain.checkpoint.resume import resume, resume_compression, resume_strategy_state, seed_everything
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv
from dptrain.runner.build import build_batches, build_engine, lr_rule, peak_lr
from dptrain.runner.facts import RunFacts
from dptrain.runner.hooks import RunContext
from dptrain.runner.hooks.build import build_hooks
from dptrain.runner.lifecycle import base_facts, open_run_dir, open_sink, program_context
from dptrain.runner.metrics import StepTimes
from dptrain.runner.outputs import evaluate, save_hf_model
from dptrain.runner.plan import RunPlan
from dptrain.runner.report import RunLog
from dptrain.runner.roll_call import is_collective_failure, roll_call
from dptrain.strategies import get_strategy
from dptrain.tasks import Task

__all__ = ["train", "timed_step", "timed_backward", "evaluate"]

WATCHDOG_MARGIN_S = 3.0  # the watchdog's wait beyond distributed.timeout_s and the roll call


def train(rp: RunPlan, env: WorkerEnv, device: torch.device,
          body: Callable[[RunPlan, WorkerEnv, torch.device, Heartbeat], RunFacts | None] | None = None) \
        -> RunFacts | None:
    """Run the training described by ``rp`` on this rank; rank 0 returns the run's facts (the summary's input).

    ``body``: the loop to run inside the heartbeat and the opened run directory (default this module's; live
    recovery's is :func:`dptrain.runner.live_loop.train_live`).

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
        return (body or _train)(rp, env, device, beat)


def _train(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat) -> RunFacts | None:
    """Build, resume, step between the hooks, save the weights: this rank's run."""
    wall0 = time.perf_counter()
    seed_everything(rp.cfg.train.seed)
    engine, compression, n_params = build_engine(rp, env, device)
    start_step, resume_note = _resume_or_seed(rp, env, engine, compression)
    log = _open_log(rp, env, device, n_params, start_step, resume_note)
    sink = open_sink(rp, env.rank, start_step, log)
    batches, batcher = build_batches(rp, env.rank, engine, start_step)
    run = RunContext(rp, env, device, engine, log, beat, sink, compression, start_step, n_params)
    hooks = build_hooks(run, batcher)
    step = start_step
    try:
        for step in range(start_step + 1, rp.cfg.train.steps + 1):
            hooks.begin_step(step)
            with hooks.measuring(step):
                info, times = timed_step(engine, rp.task, batches, weighted=batcher is not None,
                                         after_first_forward=hooks.first_forward)
            hooks.after_step(step, info, times)
        hooks.at_end(rp.cfg.train.steps)
    except Exception as e:
        _name_silent_ranks(e, step, env.world_size, rp.cfg.distributed.roll_call_s)
        raise
    finally:
        hooks.close()
    facts = _save_final_weights(run, wall0)
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
    o0 = time.perf_counter()
    info = engine.step()
    times.end = time.perf_counter()
    times.optimizer = (o0, times.end)
    return info, times


def timed_backward(engine: Engine, task: Task, batches: Iterator[Any], *, weighted: bool = False,
                   after_first_forward: Callable[[], None] | None = None) -> StepTimes:
    """A step's micro-steps of forward and backward (the gradients synchronised in the last), timed; no optimizer
    step (:func:`timed_step` takes it; live recovery takes it after the commit vote)."""
    times = StepTimes(start=time.perf_counter())
    for item in engine.micro_steps(iter(next(batches)) if weighted else batches):
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


def _resume_or_seed(rp: RunPlan, env: WorkerEnv, engine: Engine, compression) -> tuple[int, str | None]:
    """The step to start from, and what to say about the parts of the checkpoint this run cannot use.

    Ranks draw different dropout masks; a resumed run continues its saved RNG streams.
    """
    if rp.resume_from is None:
        seed_everything(rp.cfg.train.seed + 1 + env.rank)
        return 0, None
    path, strategy = rp.resume_from, rp.cfg.distributed.strategy
    start_step = resume(engine, path, env.rank, engine.device)
    notes = [resume_compression(compression, path, env.rank, env.world_size, strategy)
             if compression is not None else None,
             resume_strategy_state(engine.model, engine.optimizer, path, strategy, env.rank, env.world_size,
                                   engine.device)]
    return start_step, "; ".join(n for n in notes if n) or None


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


def _name_silent_ranks(e: Exception, step: int, world_size: int, roll_call_s: float) -> None:
    """After a failed collective, ask which ranks still answer: the error's note names the silent ones."""
    if world_size > 1 and is_collective_failure(e):
        call = roll_call(step, roll_call_s)
        e.add_note(call.note)
        e.silent_ranks = call.silent  # recorded for the local launcher, which then stops them at once


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
