"""The hooks that measure a run: metrics records, the Chrome trace, compression's bytes, dynamic batching.

Every rank times every step (``StepTimes``); only at logging steps do the ranks meet, in
one small all-gather (:class:`~dptrain.runner.metrics.StepRecorder`), and rank 0 writes the
record to ``metrics.jsonl`` and the configured backends. What the pages draw afterwards
(plots, ``report.html``) they read from those files: no hook draws anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from dptrain.api.engine import Engine, StepInfo
from dptrain.compress.base import Compressor
from dptrain.data.balance import DynamicBatcher
from dptrain.runner.hooks import RunContext, StepHook
from dptrain.runner.metrics import StepRecorder, StepTimes
from dptrain.runner.report import strategy_line
from dptrain.runner.tensor_peak import TensorPeak, data_tensors
from dptrain.runner.trace import TraceRecorder, trace_zero

__all__ = ["MetricsHook", "TraceHook", "CompressionStepHook", "BatchingHook", "strategy_record"]

Extra = Callable[[], dict]  # more fields for a metrics record; may be a collective (called on every rank)


class MetricsHook(StepHook):
    """Each step's spans into the recorder; every ``log.every`` steps and at the last, one record (collective):
    the loss averaged over the ranks, the slowest rank's times, each rank's peak memory, and ``extras``.

    On CPU the live tensors of one step, this session's second (the optimizer state exists by then), are
    counted from inside the dispatcher (:class:`TensorPeak`: slow, so one step only). Closing closes rank 0's
    sink, which the evaluation hook writes to as well.
    """

    def __init__(self, run: RunContext, recorder: StepRecorder, extras: list[Extra]):
        self.run, self.recorder, self.extras = run, recorder, extras
        steps = run.rp.cfg.train.steps
        self.every, self.last = run.rp.cfg.log.every, steps
        self.peak_step = run.start_step + min(2, max(1, steps - run.start_step))
        self.peak: TensorPeak | None = None
        self.previous = run.start_step  # the previous record's step: a line's bytes per step are the mean since

    @classmethod
    def from_config(cls, run: RunContext, extras: list[Extra]) -> MetricsHook:
        """The hook of ``run``'s config; says, under the run's header, which strategy runs and what a line shows."""
        task = run.rp.task
        run.log.info(f"strategy {strategy_line(run.rp.cfg.distributed.strategy)}; a line every {run.rp.cfg.log.every} "
                     "step(s), its MiB/step the bytes a rank reduced per step, the mean of the line's steps")
        return cls(run, StepRecorder(run.device, run.rp.plan.global_batch_size, task.tokens_per_sample), extras)

    def measuring(self, step: int) -> AbstractContextManager | None:
        if step != self.peak_step or self.run.device.type != "cpu":
            return None
        task = self.run.rp.task
        self.peak = TensorPeak(extra=_state_tensors(self.run.engine), exclude=data_tensors(task.train_set,
                                                                                             task.val_set))
        return self.peak

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        if self.peak is not None:
            self.recorder.tensor_peak_bytes, self.peak = self.peak.peak_bytes, None
        # an optimizer that communicates inside its own step reports it (dptrain.comm.step_stats.InStepComm)
        times.in_step_comm = getattr(self.run.engine.optimizer, "step_comm", None)
        self.recorder.add(times)
        self.run.log.step_done()
        if step % self.every == 0 or step == self.last:
            self._record(step, info)

    def _record(self, step: int, info: StepInfo) -> None:
        rec = self.recorder.record(step, info.loss, info.lr, info.grad_norm, self.run.engine.skipped_steps)
        for extra in self.extras:
            rec.update(extra())
        if self.run.sink is not None:
            self.run.sink.log(rec, step)
        self.run.log.train_record(rec, self.previous)
        self.previous = step
        if not math.isfinite(rec["loss"]):
            self.run.log.info(f"warning: loss is {rec['loss']} at step {step}")

    def close(self) -> None:
        if self.run.sink is not None:
            self.run.sink.close()


def _state_tensors(engine: Engine) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer state: what a step starts with (for TensorPeak)."""
    params = list(engine.model.parameters())
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return params + [p.grad for p in params if p.grad is not None] + state


class TraceHook(StepHook):
    """``log.trace_steps`` steps from ``log.trace_start`` on every rank; at the end, merged into ``trace.json``."""

    def __init__(self, run: RunContext, tracer: TraceRecorder):
        self.run, self.tracer = run, tracer

    @classmethod
    def from_config(cls, run: RunContext) -> TraceHook | None:
        """Collective (the ranks agree on time zero) when the config traces any steps; None when it does not."""
        log, env = run.rp.cfg.log, run.env
        if not log.trace_steps:
            return None
        t0 = trace_zero(env.world_size == env.local_world_size, run.device)
        return cls(run, TraceRecorder(env.rank, t0, log.trace_start + run.start_step, log.trace_steps))

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        if self.tracer.wants(step):
            self.tracer.add_step(step, times)

    def at_end(self, step: int) -> None:
        path, steps = self.run.rp.run_dir / "trace.json", self.tracer.steps
        if self.tracer.events and self.tracer.write_merged(path):  # collective
            self.run.log.info(f"trace of steps {steps.start}-{steps.stop - 1}: {path} (open in https://ui.perfetto.dev)")


class CompressionStepHook(StepHook):
    """``compression.method``: the compressor's step counter (its schedules) and the bytes it sent in each step."""

    def __init__(self, compression: Compressor):
        self.compression = compression

    def begin_step(self, step: int) -> None:
        self.compression.begin_step(step - 1)  # the compressors count steps done, from 0

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        times.compressed = self.compression.stats.close_step()


class BatchingHook(StepHook):
    """``balance.dynamic_batching``: the batcher sees each step's compute time (before the collective, without the
    optimizer) and re-divides the global batch by it; the records show each rank's share."""

    def __init__(self, batcher: DynamicBatcher):
        self.batcher = batcher

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        self.batcher.observe(step, times.compute_s - (times.optimizer[1] - times.optimizer[0]))

    def record(self) -> dict:
        return {"batch_shares": list(self.batcher.shares)}


def strategy_record(engine: Engine) -> Extra:
    """The strategy's own fields of a record (its wrapper's ``step_metrics()``, every rank: it may be a collective):
    gossip's consensus distance and mix, local SGD's averages, DiLoCo's outer steps, and the bytes they sent."""
    return engine.model.step_metrics
