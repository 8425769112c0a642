"""The worker's training run: what ``dptrain run`` executes on every rank.

The order of things, nanoGPT's:

1. join the process group, build the task and the model from the seed (the same on every
   rank; DDP broadcasts rank 0's copy anyway), the optimizer, the :class:`Engine`;
2. resume from the newest checkpoint if there is one: model, optimizer, loss scaler,
   step, and this rank's RNG states; the data position follows from the step;
3. for each optimizer step: micro-steps (forward, backward; gradient sync on the last),
   clip, learning rate from the scaled warmup-cosine schedule, optimizer step, zero_grad;
   metrics at logging steps, evaluation, checkpoints;
4. at the end: the last checkpoint, final weights as safetensors, the merged trace,
   plots and the summary.

Every step's spans are timed on every rank (``metrics.StepTimes``); the ranks exchange
them only at logging steps. Fault injection for tests of failure handling:
``DPTRAIN_FAULT=<rank>:<step>:<kill|raise>`` makes that rank SIGKILL itself or raise at
the start of that (1-based) step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from dptrain.data.balance import DynamicBatcher, DynamicLoader
from dptrain.compress import make_codec
from dptrain.compress.base import Compressor
from dptrain.compress.hook import CompressionHook
from dptrain.compress.zero import ShardedCompression
from dptrain.config import to_toml
from dptrain.runner.divergence import DivergenceMonitor, replica_tensors
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv, restart_count
from dptrain.pages.run_report import try_write_run_report
from dptrain.tasks import Task, collate
from dptrain.utils.atomic import write_text_atomic
from dptrain.runner.checkpoint import (
    SHARDED,
    prune_checkpoints,
    remove_partial,
    rng_state,
    save_checkpoint,
    set_rng_state,
    staging_dir,
)
from dptrain.api.engine import Engine, StepInfo
from dptrain.runner.faults import inject_fault, parse_fault
from dptrain.data.loader import steps_per_epoch
from dptrain.runner.log_backends import backends_from_config
from dptrain.runner.metrics import StepRecorder, StepTimes
from dptrain.optim.build import build_optimizer, decays
from dptrain.runner.outputs import save_hf_model, save_weights, val_metrics, val_sums
from dptrain.pages.plots import plot_run, read_metrics
from dptrain.runner.validate import RunPlan, compression_remedies
from dptrain.runner.ps_loop import train_ps
from dptrain.runner.report import RunLog, print_summary, summarize, truncate_metrics
from dptrain.runner.roll_call import is_collective_failure, roll_call
from dptrain.optim.schedule import scaled_lr, warmup_cosine
from dptrain.runner.skips import SkipBound
from dptrain.runner.straggler import Straggler
from dptrain.strategies.state import load_model_and_optimizer, replicated_state
from dptrain.runner.tensor_peak import TensorPeak, data_tensors
from dptrain.runner.trace import TraceRecorder, trace_zero
from dptrain.zero.checkpoint import export_safetensors, save_sharded

__all__ = ["train", "timed_step", "evaluate", "zero_kwargs_from_config"]

WATCHDOG_MARGIN_S = 3.0  # the watchdog's wait beyond ddp.timeout_s and the roll call
COMPRESSION = "compression"  # a checkpoint's per-rank error-feedback residuals
GOSSIP = "gossip"  # a gossip checkpoint's per-rank replicas and optimizer states


def train(rp: RunPlan, env: WorkerEnv, device: torch.device) -> dict | None:
    """Run the training described by ``rp`` on this rank; rank 0 returns the summary.

    A heartbeat thread (``launch.heartbeat``) beats throughout; the loop's progress marks arm its
    watchdog, which ends this rank when it makes no progress for ``ddp.timeout_s`` + the roll call's
    wait + ``WATCHDOG_MARGIN_S`` (the collective's timeout and the roll call speak first).
    """
    margin = rp.cfg.ddp.roll_call_s + WATCHDOG_MARGIN_S
    with Heartbeat(rp.run_dir, env.rank, env.world_size, rp.cfg.ddp.timeout_s, margin) as beat:
        if rp.cfg.ddp.strategy == "ps":
            return train_ps(rp, env, device, _seed_everything, beat)
        return _train(rp, env, device, beat)


def _train(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat) -> dict | None:
    cfg, run_dir, rank, plan = rp.cfg, rp.run_dir, env.rank, rp.plan
    wall0 = time.perf_counter()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        remove_partial(run_dir)
        write_text_atomic(run_dir / "config.toml", to_toml(cfg))
    dist.barrier()  # the directory exists before any rank writes into it

    _seed_everything(cfg.train.seed)
    task: Task = rp.task
    model = task.build_model().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    t = cfg.train
    peak_lr = scaled_lr(t.lr, t.lr_scaling, plan.global_batch_size, t.base_batch_size)
    nodes = cfg.ddp.ranks_per_node or env.local_world_size
    ddp_kwargs = dict(bucket_cap_mb=cfg.ddp.bucket_cap_mb, gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
                      find_unused_parameters=cfg.ddp.find_unused_parameters, static_graph=cfg.ddp.static_graph,
                      algorithm=cfg.ddp.algorithm, nodes=nodes, check_collectives=cfg.ddp.check_collectives,
                      check_timeout_s=cfg.ddp.timeout_s)
    # under momentum correction the ranks keep the momentum (dptrain.compress.dgc): the optimizer has none
    momentum = 0.0 if cfg.ddp.momentum_correction else t.momentum
    engine = Engine(model, lambda wrapped: build_optimizer(wrapped, t.optimizer, peak_lr, t.weight_decay,
                                                           tuple(t.betas), momentum),
                    plan, precision=t.precision, grad_clip=t.grad_clip,
                    lr_at=lambda s: warmup_cosine(s, peak_lr, t.warmup_steps, t.steps, t.min_lr_ratio),
                    ddp_kwargs=ddp_kwargs, strategy=cfg.ddp.strategy,
                    gossip_kwargs=dict(topology=cfg.gossip.topology),
                    zero_kwargs=_zero_kwargs(cfg, model, nodes) if cfg.ddp.strategy != "ddp" else None)
    if not engine.sharded and not engine.gossip:
        engine.model.reducer.record_spans = True
    compression = _compression_hook(cfg, engine)
    resume_note = None

    # Ranks draw different dropout masks; a resumed run continues its saved RNG streams.
    if rp.resume_from is not None:
        start_step = _resume(engine, rp.resume_from, rank, device)
        if compression is not None:
            resume_note = _resume_compression(compression, rp.resume_from, rank, env.world_size, cfg.ddp.strategy)
        if engine.gossip:
            resume_note = _resume_gossip(engine, rp.resume_from, rank, env.world_size)
    else:
        start_step = 0
        _seed_everything(t.seed + 1 + rank)

    log = RunLog(run_dir / "logs" / f"rank{rank}.log", rank, cfg.log.progress, t.steps, start_step)
    lr_rule = (f"peak {peak_lr:.3g} = {t.lr:g} x {t.lr_scaling} scaling for global batch "
               f"{plan.global_batch_size} (base {t.base_batch_size}); warmup {t.warmup_steps} steps, "
               f"cosine to {t.min_lr_ratio:g} x peak")
    log.info(f"dptrain run: task {task.name}, {n_params:,} parameters, {env.world_size} rank(s) on {device} "
             f"({dist.get_backend()}), global batch {plan.global_batch_size} = micro {plan.micro_batch_size} x "
             f"{env.world_size} ranks x {plan.grad_accum_steps} accum")
    log.info(f"learning rate: {lr_rule}")
    log.info(f"run directory: {run_dir}")
    if start_step:
        log.info(f"resumed from {rp.resume_from} at step {start_step}")
    if resume_note:
        log.info(resume_note)
    if start_step >= t.steps:
        log.info(f"nothing to do: the checkpoint is at step {start_step} and train.steps is {t.steps}")

    metrics_path = run_dir / "metrics.jsonl"
    if rank == 0:
        truncate_metrics(metrics_path, start_step)
    sink = backends_from_config(cfg, run_dir, start_step) if rank == 0 else None  # metrics.jsonl and log.backends
    for line in sink.where() if sink is not None else []:
        log.info(f"metrics also go to {line}")
    batcher = None
    if cfg.balance.dynamic_batching:
        batcher = DynamicBatcher(plan.global_batch_size, env.world_size, rank, plan.grad_accum_steps,
                                 cfg.balance.every, cfg.balance.smoothing)
        batches = DynamicLoader(task.train_set, batcher, steps_per_epoch(len(task.train_set), plan),
                                seed=t.seed, collate_fn=collate(task)).steps(start_step)
    else:
        batches = engine.loader(task.train_set, seed=t.seed, collate_fn=collate(task)).micro_batches(start_step)
    recorder = StepRecorder(device, plan.global_batch_size, task.tokens_per_sample)
    # the step whose live tensors are counted on CPU: this session's second, when the optimizer state exists
    peak_step = start_step + min(2, max(1, t.steps - start_step))
    t0 = trace_zero(env.world_size == env.local_world_size, device)
    tracer = TraceRecorder(rank, t0, cfg.log.trace_start + start_step, cfg.log.trace_steps)
    fault = parse_fault(os.environ.get("DPTRAIN_FAULT", ""))
    straggler = Straggler(cfg.straggler.factor) if cfg.straggler.rank == rank else None
    monitor = _divergence_monitor(cfg, engine)
    skips = SkipBound(t.max_skipped_steps, engine.skipped_steps)
    try:
        for step in range(start_step + 1, t.steps + 1):
            beat.mark(step)
            if fault and fault[:2] == (rank, step):
                inject_fault(fault[2], rank, step, engine.model)
            peak = TensorPeak(extra=_state_tensors(engine), exclude=data_tensors(task.train_set, task.val_set)) \
                if step == peak_step and device.type == "cpu" else None
            if compression is not None:
                compression.begin_step(step - 1)
            with peak or contextlib.nullcontext():
                info, times = timed_step(engine, task, batches, compression, straggler, batcher)
            if peak is not None:
                recorder.tensor_peak_bytes = peak.peak_bytes
            recorder.add(times)
            skips.check(step, engine.skipped_steps)
            if batcher is not None:  # compute before the collective, without the optimizer
                batcher.observe(step, times.compute_s - (times.optimizer[1] - times.optimizer[0]))
            if tracer.wants(step):
                tracer.add_step(step, times)
            log.step_done()
            if monitor and step % cfg.divergence.every == 0:
                found = monitor.check(step)  # raises DivergenceError on every rank unless repair is on
                if found:
                    log.info(f"warning: replicas diverged at step {step}: {found.tensor} differs first "
                             f"({found.differing} tensors), rank(s) {found.bad_ranks} off the majority; repaired "
                             f"from rank {found.source}")
            if step % cfg.log.every == 0 or step == t.steps:
                rec = recorder.record(step, info.loss, info.lr, info.grad_norm, engine.skipped_steps)
                if batcher is not None:
                    rec["batch_shares"] = list(batcher.shares)
                if engine.gossip:  # collective, at the same logging steps on every rank
                    rec["consensus_distance"] = engine.model.consensus_distance()
                    rec["comm_bytes_per_step"] = rec["comm_sent_bytes_per_step"] = engine.model.bytes_per_mix
                    rec["gossip_mix_ms"] = 1e3 * engine.model.last_mix_s
                if rank == 0:
                    sink.log(rec, step)
                log.train_record(rec)
                if not math.isfinite(rec["loss"]):
                    log.info(f"warning: loss is {rec['loss']} at step {step}")
            saved = False
            if engine.gossip and step == t.steps:
                # the last checkpoint keeps each rank's own replica, so a longer run resumed from it continues
                # exactly; the model to evaluate and keep is the replicas' average
                _save(engine, rp, step, env, device, log, compression)
                saved = True
                engine.model.average_()
            if (cfg.log.eval_every and step % cfg.log.eval_every == 0) or step == t.steps:
                beat.mark(step, "eval")
                ev = evaluate(engine, task, cfg.log.eval_batches)
                ev = {"kind": "eval", "step": step, **ev, "time": time.time()}
                if rank == 0:
                    sink.log(ev, step)
                log.info(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()
                                                              if k.startswith("val_")))
            if not saved and ((cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == t.steps):
                beat.mark(step, "checkpoint")
                _save(engine, rp, step, env, device, log, compression)
        skips.check_end(t.steps - start_step)
    except Exception as e:
        if env.world_size > 1 and is_collective_failure(e):  # name the ranks that stopped or died
            call = roll_call(step, cfg.ddp.roll_call_s)
            e.add_note(call.note)
            e.silent_ranks = call.silent  # recorded for the local launcher, which then stops them at once
        raise
    finally:
        if sink is not None:
            sink.close()
    beat.disarm()  # the end's barrier, collectives and gloo's timeout still bound it

    if cfg.log.trace_steps and tracer.events and tracer.write_merged(run_dir / "trace.json"):
        log.info(f"trace of steps {tracer.steps.start}-{tracer.steps.stop - 1}: {run_dir / 'trace.json'} "
                 "(open in https://ui.perfetto.dev)")
    summary = None
    if engine.sharded:  # collective: every rank's shards are gathered to rank 0
        export_safetensors(engine.model, run_dir / "model.safetensors")
    if rank == 0:
        if not engine.sharded:
            save_weights(engine.model.module, run_dir / "model.safetensors")
        else:
            (run_dir / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
        save_hf_model(cfg, run_dir, log)
        train_recs, evals = read_metrics(metrics_path)
        if cfg.log.plots:
            plot_run(run_dir, title=f"{task.name} on {env.world_size} rank(s), global batch {plan.global_batch_size}")
        info = {"run_dir": str(run_dir), "task": task.name, "parameters": n_params, "world_size": env.world_size,
                "device": device.type, "backend": dist.get_backend(), "global_batch_size": plan.global_batch_size,
                "micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps,
                "lr_rule": lr_rule, "peak_lr": peak_lr, "start_step": start_step, "steps": t.steps,
                "restarts": restart_count(),
                "wall_s": time.perf_counter() - wall0}
        summary = summarize(run_dir, info, train_recs, evals)
        if cfg.log.plots:  # after the summary, which it shows; a failure is a warning, never a failed run
            try_write_run_report(run_dir, summary, cfg, log.info)
            if (run_dir / "report.html").exists():  # listed as summary.json is: printed, not inside summary.json
                summary["files"]["report.html"] = (run_dir / "report.html").stat().st_size
        print_summary(summary, log)
    log.close()
    dist.barrier()
    return summary


def _divergence_monitor(cfg, engine: Engine) -> DivergenceMonitor | None:
    """The replica check of ``[divergence]``: parameters and buffers, and the optimizer state where replicated."""
    if not cfg.divergence.every:
        return None
    module = engine.model.module if hasattr(engine.model, "module") else engine.model
    optimizer = None if engine.sharded else engine.optimizer
    return DivergenceMonitor(lambda: replica_tensors(module, optimizer), repair=cfg.divergence.repair)


def _state_tensors(engine: Engine) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer state: what a step starts with (for TensorPeak)."""
    params = list(engine.model.parameters())
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return params + [p.grad for p in params if p.grad is not None] + state


def timed_step(engine: Engine, task: Task, batches: Iterator[Any], compression: Compressor | None = None,
               straggler: Straggler | None = None,
               batcher: DynamicBatcher | None = None) -> tuple[StepInfo, StepTimes]:
    """One optimizer step (all its micro-steps), with the wall-clock spans of its parts.

    An injected straggler's sleep is part of its forward span: it is compute, as a slow device's would be.
    With dynamic batching ``batches`` yields a step's [(micro-batch, loss weight)] at a time
    (:class:`dptrain.data.balance.DynamicLoader`), and the batcher sees the step's compute time.
    """
    times = StepTimes(start=time.perf_counter())
    for item in engine.micro_steps(iter(next(batches)) if batcher else batches):
        batch, weight = item if batcher else (item, None)
        f0 = time.perf_counter()
        with engine.autocast():
            loss = task.loss(engine.model, batch)
        if straggler and not times.forward:
            straggler.delay()
        f1 = time.perf_counter()
        engine.backward(loss, weight)
        times.forward.append((f0, f1))
        times.backward.append((f1, time.perf_counter()))
    times.comm = getattr(engine.model, "last_step_comm", None)  # the DDP engine's statistics
    if straggler:  # forward and backward, less the wait for gradients at the end of backward
        straggler.step_done(sum(e - s for s, e in times.forward + times.backward) - times.exposed_comm_s)
    times.compressed = compression.stats.close_step() if compression is not None else None
    o0 = time.perf_counter()
    info = engine.step()
    times.end = time.perf_counter()
    times.optimizer = (o0, times.end)
    return info, times


def evaluate(engine: Engine, task: Task, num_batches: int) -> dict[str, float]:
    """Validation metrics over ``num_batches`` micro-batches per rank, summed over all ranks."""
    # DDP: the bare module (no gradient sync or buffer broadcast needed); ZeRO: the
    # wrapper, which gathers the parameters (and under no_grad frees them again)
    model = engine.model if engine.sharded else engine.model.module
    sums = val_sums(model, task, engine.plan.micro_batch_size, num_batches, dist.get_world_size(), dist.get_rank(),
                    engine.to_device, engine.autocast)
    keys = sorted(sums)
    totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=engine.device)
    dist.all_reduce(totals)
    return val_metrics(dict(zip(keys, totals.tolist())))


def _save(engine: Engine, rp: RunPlan, step: int, env: WorkerEnv, device: torch.device, log: RunLog,
          compression: Compressor | None = None) -> None:
    """Collective: gather every rank's RNG state; rank 0 writes the checkpoint.

    Files of every rank (ZeRO's shards, the compression residuals, which differ per rank)
    are written into the staging directory first; rank 0's rename publishes them all.
    """
    states: list = [None] * env.world_size
    dist.all_gather_object(states, rng_state(device))
    every_rank = engine.sharded or compression is not None or engine.gossip
    if every_rank:
        staged = staging_dir(rp.run_dir, step)
        if env.rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        dist.barrier()
        if engine.sharded:
            save_sharded(staged / SHARDED, engine.model, engine.optimizer)
        if compression is not None:
            (staged / COMPRESSION).mkdir(exist_ok=True)
            torch.save(compression.state_dict(), staged / COMPRESSION / f"rank{env.rank}.pt")
        if engine.gossip:  # the replicas differ: each rank's own, with its optimizer state and mixing step
            (staged / GOSSIP).mkdir(exist_ok=True)
            torch.save({"model": engine.model.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                        "mix_steps": engine.model.steps}, staged / GOSSIP / f"rank{env.rank}.pt")
        if compression is not None or engine.gossip:
            dist.barrier()
    if env.rank == 0:
        trainer = {"step": engine.step_count, "skipped_steps": engine.skipped_steps, "rng": states,
                   "world_size": env.world_size}
        if engine.scaler is not None:
            trainer["scaler"] = engine.scaler.state_dict()
        meta = {"identity": rp.identity, "identity_hash": rp.identity_hash,
                "global_batch_size": rp.plan.global_batch_size, "world_size": env.world_size,
                "torch_version": torch.__version__, "format": "sharded" if engine.sharded else "replicated",
                "strategy": rp.cfg.ddp.strategy, "data": rp.data_identity}
        files = {"trainer.pt": trainer}
        if not engine.sharded:  # the names every strategy reads (strategies/state.py)
            model_state, optim_state = replicated_state(engine.model.module, engine.optimizer)
            files = {"model.pt": model_state, "optimizer.pt": optim_state, **files}
        path = save_checkpoint(rp.run_dir, step, files, meta, staged=every_rank)
        deleted = prune_checkpoints(rp.run_dir, rp.cfg.checkpoint.keep_last)
        log.info(f"checkpoint {path.name} saved" + (f" ({len(deleted)} older deleted)" if deleted else ""),
                 console=False)
    dist.barrier()  # a rank that fails after this point finds the checkpoint complete


def _resume(engine: Engine, path: Path, rank: int, device: torch.device) -> int:
    """Model, optimizer, step and RNG states from ``path``, whichever strategy wrote it (strategies/state.py)."""
    trainer = torch.load(path / "trainer.pt", map_location=device, weights_only=True)
    load_model_and_optimizer(path, engine, device)  # collective when both are sharded (DCP reshards)
    engine.step_count, engine.skipped_steps = trainer["step"], trainer.get("skipped_steps", 0)
    if engine.scaler is not None and "scaler" in trainer:
        engine.scaler.load_state_dict(trainer["scaler"])
    rngs = trainer["rng"]
    if rank < len(rngs):
        set_rng_state(rngs[rank], device)
    else:  # resumed on more ranks than saved: new ranks get fresh streams
        _seed_everything(engine.plan.world_size * 7919 + rank + trainer["step"])
    return trainer["step"]


def _resume_compression(hook: Compressor, path: Path, rank: int, world_size: int, strategy: str) -> str | None:
    """Load this rank's error-feedback residuals when the checkpoint has them for this world size and strategy.

    Returns what to tell the user when they start from zero instead.
    """
    saved = path / COMPRESSION / f"rank{rank}.pt"
    meta = json.loads((path / "meta.json").read_text())
    meta_world, saved_by = meta.get("world_size"), meta.get("strategy")
    if meta_world == world_size and saved.exists() and saved_by in (None, strategy):
        hook.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))
        return None
    reason = (f"the checkpoint was saved on {meta_world} ranks, this run has {world_size}"
              if meta_world != world_size else f"the checkpoint was saved by strategy {saved_by}, this run is "
              f"{strategy}" if saved.exists() else "the checkpoint has none")
    return f"compression residuals start from zero: {reason}"


def _resume_gossip(engine: Engine, path: Path, rank: int, world_size: int) -> str | None:
    """Load this rank's own replica and optimizer state (a gossip checkpoint saved on as many ranks).

    On another world size every replica starts from rank 0's copy (already loaded); returns what to say.
    """
    saved = path / GOSSIP / f"rank{rank}.pt"
    meta_world = json.loads((path / "meta.json").read_text()).get("world_size")
    if meta_world != world_size or not saved.exists():
        return (f"gossip replicas start from rank 0's copy: the checkpoint was saved on {meta_world} ranks, this "
                f"run has {world_size}")
    state = torch.load(saved, map_location=engine.device, weights_only=True)
    engine.model.module.load_state_dict(state["model"])  # copies into the flat buffer's views
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.model.steps = state["mix_steps"]
    return None


def _zero_kwargs(cfg, model: torch.nn.Module, nodes: int) -> dict[str, Any]:
    """ZeRO's arguments, with the compressed reduce-scatter ``[ddp] compression`` asks for."""
    kwargs = zero_kwargs_from_config(cfg, model, nodes)
    if cfg.ddp.compression != "none":
        kwargs["compression"] = ShardedCompression(make_codec(cfg.ddp.compression), cfg.ddp.error_feedback)
    return kwargs


def _compression_hook(cfg, engine: Engine) -> Compressor | None:
    """The compression ``[ddp] compression`` asks for: the DDP engine's hook, or ZeRO's (None: uncompressed)."""
    d = cfg.ddp
    if d.compression == "none":
        return None
    if engine.sharded:
        return engine.model.compression
    codec = make_codec(d.compression, topk_fraction=d.topk_fraction, powersgd_rank=d.powersgd_rank)
    hook = CompressionHook(codec, error_feedback=d.error_feedback, remedies=compression_remedies(cfg))
    engine.model.register_comm_hook(None, hook)
    return hook


def zero_kwargs_from_config(cfg, model: torch.nn.Module, nodes: int) -> dict[str, Any]:
    """ZeRO's arguments from ``[ddp]`` and ``[zero]``; unit class names resolved against the model."""
    z = cfg.zero
    kwargs: dict[str, Any] = dict(algorithm=cfg.ddp.algorithm, nodes=nodes, split_by=decays,
                                  reduce_dtype=torch.bfloat16 if z.reduce_dtype == "bf16" else torch.float32,
                                  check_collectives=cfg.ddp.check_collectives, check_timeout_s=cfg.ddp.timeout_s,
                                  find_unused_parameters=cfg.ddp.find_unused_parameters,
                                  shard_size=z.shard_size or None)
    if cfg.ddp.bucket_cap_mb is not None and cfg.ddp.strategy != "zero3":
        kwargs["bucket_cap_mb"] = cfg.ddp.bucket_cap_mb
    if cfg.ddp.strategy != "zero3":
        return kwargs
    kwargs.update(reshard_after_forward=z.reshard_after_forward, prefetch=z.prefetch)
    classes = {type(m).__name__: type(m) for m in model.modules()}
    if z.unit_classes:
        unknown = [name for name in z.unit_classes if name not in classes]
        if unknown:
            raise ValueError(f"zero.unit_classes {unknown} do not occur in the model; its module classes are "
                             f"{sorted(classes)}")
        kwargs["unit_classes"] = tuple(classes[name] for name in z.unit_classes)
    elif z.min_unit_numel:
        kwargs["min_unit_numel"] = z.min_unit_numel
    else:  # the blocks of the first ModuleList (a transformer's layers), else about 8 units by size
        blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)), None)
        if blocks is not None:
            kwargs["unit_classes"] = tuple({type(b) for b in blocks})
        else:
            kwargs["min_unit_numel"] = max(1, sum(p.numel() for p in model.parameters()) // 8)
    return kwargs


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
