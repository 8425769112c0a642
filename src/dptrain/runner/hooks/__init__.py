"""Step hooks: the optional machinery of a training run, hung off the loop so the loop shows the algorithm.

The loop (:mod:`dptrain.runner.loop`) does one thing per step: ``timed_step`` (micro-steps of
forward and backward, then the optimizer). Everything else a run does around it is a
:class:`StepHook`, configured from the run's config
(:func:`dptrain.runner.hooks.build.build_hooks`): the heartbeat,
fault and straggler injection, the skipped-steps bound, dynamic batching, compression's
per-step bookkeeping, the divergence check, metrics, the trace, evaluation and checkpoints.
A hook overrides only the moments it needs:

- ``begin_step(step)``: before the step (1-based);
- ``measuring(step)``: a context manager around the step, or None (the tensor-peak count);
- ``after_first_forward()``: inside the step, after its first forward (a straggler's sleep
  belongs to the forward span, as a slow device's compute would);
- ``after_step(step, info, times)``: after the optimizer step, with its :class:`StepInfo` and
  :class:`StepTimes`;
- ``at_end(step)``: after the last step (not after a failure);
- ``close()``: always, last (a failed run closes its files too).

The hooks run in the order :func:`~dptrain.runner.hooks.build.build_hooks` lists them, the
same on every rank: several are collectives (the divergence check, the metrics record,
evaluation, checkpoints), and the ranks must meet in them in the same order. Where they live:
:mod:`~dptrain.runner.hooks.guard` (heartbeat, faults, straggler, skipped steps, divergence),
:mod:`~dptrain.runner.hooks.metrics` (metrics, trace, compression's bytes, dynamic batching),
:mod:`~dptrain.runner.hooks.checkpoint` (evaluation and checkpoints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dptrain.api.engine import Engine, StepInfo
from dptrain.checkpoint.run_state import Part
from dptrain.compress.base import Compressor
from dptrain.launch.heartbeat import Heartbeat
from dptrain.launch.rendezvous import WorkerEnv
from dptrain.runner.log_backends import LogBackends
from dptrain.runner.metrics import StepTimes
from dptrain.runner.plan import RunPlan
from dptrain.runner.report import RunLog

__all__ = ["StepHook", "Hooks", "RunContext"]


class StepHook:
    """One concern of a run, called at the moments of a step it overrides (see the module docstring)."""

    def begin_step(self, step: int) -> None:
        pass

    def measuring(self, step: int) -> contextlib.AbstractContextManager | None:
        return None

    def after_first_forward(self) -> None:
        pass

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        pass

    def at_end(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class Hooks:
    """The run's hooks, called in order; ``first_forward`` is None when no hook needs that moment."""

    def __init__(self, hooks: list[StepHook]):
        self.hooks = hooks
        inside = [h for h in hooks if type(h).after_first_forward is not StepHook.after_first_forward]
        self.first_forward: Callable[[], None] | None = (lambda: [h.after_first_forward() for h in inside]) \
            if inside else None

    def begin_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.begin_step(step)

    def measuring(self, step: int) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for hook in self.hooks:
            context = hook.measuring(step)
            if context is not None:
                stack.enter_context(context)
        return stack

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        for hook in self.hooks:
            hook.after_step(step, info, times)

    def at_end(self, step: int) -> None:
        for hook in self.hooks:
            hook.at_end(step)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()


@dataclass
class RunContext:
    """What the hooks of one rank's run share: the plan, this rank, the engine and where things are said."""

    rp: RunPlan
    env: WorkerEnv
    device: torch.device
    engine: Engine
    log: RunLog
    beat: Heartbeat
    sink: LogBackends | None  # rank 0's metrics.jsonl and log.backends; None on the other ranks
    compression: Compressor | None
    start_step: int
    parameters: int  # the model's, counted before a strategy sharded them
    checkpoint_meta: Callable[[], dict] | None = None  # more for a checkpoint's meta.json (live recovery's position)
    parts: list[Part] = field(default_factory=list)  # the run's state beside the engine (checkpoint.run_state)
