"""The worker's training run: what ``dptrain run`` executes on every rank.

The order of things, nanoGPT's, in :func:`_train`:

1. join the run directory, build the task's model from the seed (the same on every rank; the
   wrapper broadcasts rank 0's copy anyway), the :class:`Engine` with its strategy's wrapper
   (:mod:`dptrain.runner.build`, through the registry);
2. resume from the newest checkpoint if there is one: model, optimizer, loss scaler, step, and
   this rank's RNG states (:mod:`dptrain.runner.resume`); the data position follows from the step;
3. for each optimizer step: :func:`timed_step` (micro-steps of forward and backward, gradient
   sync on the last; clip, learning rate, optimizer step), between the step hooks' moments
   (:mod:`dptrain.runner.hooks`: heartbeat, faults, straggler, skipped steps, dynamic batching,
   trace, divergence, metrics, evaluation, checkpoints, each configured from the config);
4. at the end: the final weights as safetensors, and on rank 0 the run's facts, returned.

The loop draws nothing: its caller (``dptrain.run``) makes the plots, ``summary.json`` and
``report.html`` from the run directory's files (:mod:`dptrain.pages.finish`). A strategy with a
loop of its own (the parameter server: see :mod:`dptrain.runner.ps_loop` for why) trains there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from dptrain.api.engine import Engine, StepInfo
from dptrain.config import to_toml
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv, restart_count
from dptrain.runner.build import build_batches, build_engine, lr_rule, peak_lr
from dptrain.runner.checkpoint import remove_partial
from dptrain.runner.hooks import RunContext
from dptrain.runner.hooks_config import build_hooks
from dptrain.runner.log_backends import LogBackends, backends_from_config
from dptrain.runner.metrics import StepTimes
from dptrain.runner.outputs import evaluate, save_hf_model, save_weights
from dptrain.runner.plan import RunPlan
from dptrain.runner.ps_loop import train_ps
from dptrain.runner.report import RunLog, truncate_metrics
from dptrain.runner.resume import resume, resume_compression, resume_replicas, seed_everything
from dptrain.runner.roll_call import is_collective_failure, roll_call
from dptrain.strategies import get_strategy
from dptrain.tasks import Task
from dptrain.utils.atomic import write_text_atomic
from dptrain.zero.checkpoint import export_safetensors

__all__ = ["train", "timed_step", "evaluate"]

WATCHDOG_MARGIN_S = 3.0  # the watchdog's wait beyond ddp.timeout_s and the roll call


def train(rp: RunPlan, env: WorkerEnv, device: torch.device) -> dict | None:
    """Run the training described by ``rp`` on this rank; rank 0 returns the run's facts (the summary's input).

    A heartbeat thread (``launch.heartbeat``) beats throughout; the loop's progress marks arm its
    watchdog, which ends this rank when it makes no progress for ``ddp.timeout_s`` + the roll call's
    wait + ``WATCHDOG_MARGIN_S`` (the collective's timeout and the roll call speak first).
    """
    margin = rp.cfg.ddp.roll_call_s + WATCHDOG_MARGIN_S
    with Heartbeat(rp.run_dir, env.rank, env.world_size, rp.cfg.ddp.timeout_s, margin) as beat:
        if get_strategy(rp.cfg.ddp.strategy).own_loop:
            return train_ps(rp, env, device, beat)
        return _train(rp, env, device, beat)


def _train(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat) -> dict | None:
    """Build, resume, step between the hooks, save the weights: this rank's run."""
    wall0 = time.perf_counter()
    _open_run_dir(rp, env.rank)
    seed_everything(rp.cfg.train.seed)
    engine, compression, n_params = build_engine(rp, env, device)
    start_step, resume_note = _resume_or_seed(rp, env, engine, compression)
    log = _open_log(rp, env, device, n_params, start_step, resume_note)
    sink = _metrics_sink(rp, env.rank, start_step, log)
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
        _name_silent_ranks(e, step, env.world_size, rp.cfg.ddp.roll_call_s)
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
    o0 = time.perf_counter()
    info = engine.step()
    times.end = time.perf_counter()
    times.optimizer = (o0, times.end)
    return info, times


def _open_run_dir(rp: RunPlan, rank: int) -> None:
    """``logs/`` and, on rank 0, config.toml; a staged checkpoint a crash left behind is removed."""
    (rp.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        remove_partial(rp.run_dir)
        write_text_atomic(rp.run_dir / "config.toml", to_toml(rp.cfg))
    dist.barrier()  # the directory exists before any rank writes into it


def _resume_or_seed(rp: RunPlan, env: WorkerEnv, engine: Engine, compression) -> tuple[int, str | None]:
    """The step to start from, and what to say about the parts of the checkpoint this run cannot use.

    Ranks draw different dropout masks; a resumed run continues its saved RNG streams.
    """
    if rp.resume_from is None:
        seed_everything(rp.cfg.train.seed + 1 + env.rank)
        return 0, None
    start_step, note = resume(engine, rp.resume_from, env.rank, engine.device), None
    if compression is not None:
        note = resume_compression(compression, rp.resume_from, env.rank, env.world_size, rp.cfg.ddp.strategy)
    if engine.gossip:  # each rank's own replica (gossip's replicas differ by design)
        note = resume_replicas(engine, rp.resume_from, env.rank, env.world_size)
    return start_step, note


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


def _metrics_sink(rp: RunPlan, rank: int, start_step: int, log: RunLog) -> LogBackends | None:
    """Rank 0's metrics.jsonl (records after ``start_step`` dropped: a resumed run writes them again) and
    ``log.backends``; None on the other ranks."""
    if rank != 0:
        return None
    note = truncate_metrics(rp.run_dir / "metrics.jsonl", start_step)
    if note:
        log.info(note)
    sink = backends_from_config(rp.cfg, rp.run_dir, start_step)
    for line in sink.where():
        log.info(f"metrics also go to {line}")
    return sink


def _name_silent_ranks(e: Exception, step: int, world_size: int, roll_call_s: float) -> None:
    """After a failed collective, ask which ranks still answer: the error's note names the silent ones."""
    if world_size > 1 and is_collective_failure(e):
        call = roll_call(step, roll_call_s)
        e.add_note(call.note)
        e.silent_ranks = call.silent  # recorded for the local launcher, which then stops them at once


def _save_final_weights(run: RunContext, wall0: float) -> dict | None:
    """model.safetensors (collective when sharded: every rank's shards gathered to rank 0) and the Hugging Face
    export; rank 0 returns the run's facts."""
    engine, rp, path = run.engine, run.rp, run.rp.run_dir / "model.safetensors"
    if engine.sharded:
        export_safetensors(engine.model, path)
    if run.env.rank != 0:
        return None
    if engine.sharded:
        path.chmod(0o644)  # safetensors creates it owner-only
    else:
        save_weights(engine.model.module, path)
    save_hf_model(rp.cfg, rp.run_dir, run.log)
    return _facts(run, time.perf_counter() - wall0)


def _facts(run: RunContext, wall_s: float) -> dict[str, Any]:
    """What the run was, for the summary (:func:`dptrain.runner.report.summarize`)."""
    rp, plan, env = run.rp, run.rp.plan, run.env
    return {"run_dir": str(rp.run_dir), "task": rp.task.name, "parameters": run.parameters,
            "world_size": env.world_size, "device": run.device.type, "backend": dist.get_backend(),
            "global_batch_size": plan.global_batch_size, "micro_batch_size": plan.micro_batch_size,
            "grad_accum_steps": plan.grad_accum_steps, "lr_rule": lr_rule(rp), "peak_lr": peak_lr(rp),
            "start_step": run.start_step, "steps": rp.cfg.train.steps, "restarts": restart_count(),
            "wall_s": wall_s}
