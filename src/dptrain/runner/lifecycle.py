"""What every run does around its training, whichever program trains: one lifecycle for the SPMD loop and for a
strategy's own program.

A run opens its directory (``logs/``, a staged checkpoint a crash left behind removed,
``config.toml``), parses its injected fault once, opens rank 0's metrics sink (records a
resumed run writes again dropped, a torn last line dropped with a note) and each rank's
log, and ends with its weights and the :class:`~dptrain.runner.facts.RunFacts` the pages
read. The SPMD loop (:mod:`dptrain.runner.loop`) uses these directly. A strategy whose
ranks run different programs (the parameter server) gets them bundled as a
:class:`ProgramContext`, with what its program needs from the runner's other machinery
(the learning-rate schedule, the optimizer, this rank's batches, the straggler, the
trace, the tensor-peak count, the evaluation and the weights), so that its package
imports nothing above itself and copies none of this.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.checkpoint.files import remove_partial
from dptrain.config import to_toml
from dptrain.data.loader import ShardedLoader
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv, restart_count
from dptrain.optim.build import build_optimizer
from dptrain.optim.schedule import scaled_lr, warmup_cosine
from dptrain.runner.facts import RunFacts
from dptrain.runner.faults import inject_fault, parse_fault
from dptrain.runner.log_backends import LogBackends, backends_from_config
from dptrain.runner.metrics import peak_rss_mb, peak_tensor_mb
from dptrain.runner.outputs import save_hf_model, save_weights, val_metrics, val_sums
from dptrain.runner.plan import RunPlan
from dptrain.runner.report import RunLog, truncate_metrics
from dptrain.runner.straggler import Straggler
from dptrain.runner.tensor_peak import TensorPeak, data_tensors
from dptrain.runner.trace import TraceRecorder
from dptrain.tasks import collate
from dptrain.utils.atomic import write_text_atomic

__all__ = ["open_run_dir", "run_fault", "open_sink", "base_facts", "ProgramContext", "program_context"]


def open_run_dir(rp: RunPlan, rank: int) -> None:
    """``logs/`` and, on rank 0, config.toml; a staged checkpoint a crash left behind is removed (collective)."""
    (rp.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        remove_partial(rp.run_dir)
        write_text_atomic(rp.run_dir / "config.toml", to_toml(rp.cfg))
    dist.barrier()  # the directory exists before any rank writes into it


def run_fault() -> tuple[int, int, str] | None:
    """``DPTRAIN_FAULT``, parsed once for the run (``runner.faults``)."""
    return parse_fault(os.environ.get("DPTRAIN_FAULT", ""))


def open_sink(rp: RunPlan, rank: int, start_step: int, log: RunLog) -> LogBackends | None:
    """Rank 0's metrics.jsonl (records after ``start_step`` dropped: a resumed run writes them again; a torn last line
    dropped with a note) and ``log.backends``; None on the other ranks."""
    if rank != 0:
        return None
    note = truncate_metrics(rp.run_dir / "metrics.jsonl", start_step)
    if note:
        log.info(note)
    sink = backends_from_config(rp.cfg, rp.run_dir, start_step)
    for line in sink.where():
        log.info(f"metrics also go to {line}")
    return sink


def base_facts(rp: RunPlan, env: WorkerEnv, device: torch.device, parameters: int, start_step: int, wall_s: float,
               lr_rule: str, peak_lr: float, **strategy: Any) -> RunFacts:
    """The run's facts every program reports the same way; ``strategy``: what the strategy adds (``layout``...)."""
    plan = rp.plan
    return RunFacts(run_dir=str(rp.run_dir), task=rp.task.name, parameters=parameters, world_size=env.world_size,
                    device=device.type, backend=dist.get_backend(), global_batch_size=plan.global_batch_size,
                    micro_batch_size=plan.micro_batch_size, grad_accum_steps=plan.grad_accum_steps, lr_rule=lr_rule,
                    peak_lr=peak_lr, start_step=start_step, steps=rp.cfg.train.steps, restarts=restart_count(),
                    wall_s=wall_s, strategy=rp.cfg.distributed.strategy, **strategy)


@dataclass
class ProgramContext:
    """What the runner hands a strategy's own program (the entry's ``program``): the run, this rank, and the runner's
    machinery as values and callables, so the program's package imports nothing above itself.

    ``rp``: the checked run (its config, plan, task, checkpoint to resume); ``fault``:
    ``DPTRAIN_FAULT`` parsed; ``lr_at(step)``, ``peak_lr``: the schedule; ``optimizer(params)``:
    the run's optimizer over ``params``; ``open_log(start_step)``: this rank's log;
    ``open_sink(start_step, log)``: rank 0's metrics sink (None elsewhere);
    ``batches(rank, start)``: this rank's micro-batches from its ``start``-th;
    ``inject_fault(kind, rank, step, model)``; ``straggler``: this rank's, or None;
    ``tracer(start)``: rank 0's trace recorder of the configured steps from ``start``, or None;
    ``tensor_peak(model)``: a context counting one step's live tensors (CPU);
    ``memory(tensor_peak_bytes)``: this rank's peak resident MiB and tensor MiB;
    ``finish(model, start_step, wall0, sink, log, **strategy)``: rank 0's final evaluation (alone),
    weights and facts.
    """

    rp: RunPlan
    env: WorkerEnv
    device: torch.device
    beat: Heartbeat
    fault: tuple[int, int, str] | None
    peak_lr: float
    lr_at: Callable[[int], float]
    optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
    open_log: Callable[[int], RunLog]
    open_sink: Callable[[int, RunLog], LogBackends | None]
    batches: Callable[[int, int], Iterator[Any]]
    inject_fault: Callable[..., None]
    straggler: Straggler | None
    tracer: Callable[[int], TraceRecorder | None]
    tensor_peak: Callable[[nn.Module], contextlib.AbstractContextManager]
    memory: Callable[[int | None], tuple[float, float | None]]
    finish: Callable[..., RunFacts]


def program_context(rp: RunPlan, env: WorkerEnv, device: torch.device, beat: Heartbeat) -> ProgramContext:
    """The :class:`ProgramContext` of this rank's run."""
    cfg, t, plan, task = rp.cfg, rp.cfg.train, rp.plan, rp.task
    peak = scaled_lr(t.lr, t.lr_scaling, plan.global_batch_size, t.base_batch_size)
    rank = env.rank

    def batches(worker: int, start: int) -> Iterator[Any]:
        return ShardedLoader(task.train_set, plan, worker, seed=t.seed, collate_fn=collate(task)).micro_batches(start)

    def tracer(start: int) -> TraceRecorder | None:
        if rank != 0 or not cfg.log.trace_steps:
            return None
        return TraceRecorder(0, time.perf_counter(), cfg.log.trace_start + start, cfg.log.trace_steps)

    def tensor_peak(model: nn.Module) -> contextlib.AbstractContextManager:
        if device.type != "cpu":
            return contextlib.nullcontext()
        return TensorPeak(extra=model.parameters(), exclude=data_tensors(task.train_set, task.val_set))

    def memory(tensor_peak_bytes: int | None) -> tuple[float, float | None]:
        return peak_rss_mb(), peak_tensor_mb(device, tensor_peak_bytes)

    def finish(model: nn.Module, start_step: int, wall0: float, sink: LogBackends, log: RunLog,
               **strategy: Any) -> RunFacts:
        """Rank 0 alone (no collective: a worker may be gone): the final parameters evaluated on the samples all the
        data ranks together would take, saved; the facts."""
        sums = val_sums(model, task, plan.micro_batch_size, cfg.log.eval_batches * plan.world_size)
        ev = {"kind": "eval", "step": t.steps, **val_metrics(sums), "time": time.time()}
        sink.log(ev, t.steps)
        log.info(f"eval of the final parameters: val_loss {ev['val_loss']:.4f}")
        save_weights(model, rp.run_dir / "model.safetensors")
        save_hf_model(cfg, rp.run_dir, log)
        return base_facts(rp, env, device, sum(x.numel() for x in model.parameters()), start_step,
                          time.perf_counter() - wall0, f"peak {peak:.3g}", peak, **strategy)

    return ProgramContext(
        rp=rp, env=env, device=device, beat=beat, fault=run_fault(), peak_lr=peak,
        lr_at=lambda s: warmup_cosine(s, peak, t.warmup_steps, t.steps, t.min_lr_ratio),
        optimizer=lambda params: build_optimizer(params, t.optimizer, peak, t.weight_decay, tuple(t.betas),
                                                 t.momentum),
        open_log=lambda start: RunLog(rp.run_dir / "logs" / f"rank{rank}.log", rank, cfg.log.progress, t.steps,
                                      start),
        open_sink=lambda start, log: open_sink(rp, rank, start, log), batches=batches, inject_fault=inject_fault,
        straggler=Straggler(cfg.straggler.factor) if cfg.straggler.rank == rank else None, tracer=tracer,
        tensor_peak=tensor_peak, memory=memory, finish=finish)
