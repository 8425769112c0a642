"""The hooks that watch over a run or disturb it on purpose: heartbeat, injected faults and stragglers,
the bound on skipped steps, the replicas' divergence check.

Each wraps one module of the runner that holds the algorithm (:mod:`~dptrain.runner.faults`,
:mod:`~dptrain.runner.straggler`, :mod:`~dptrain.runner.skips`, :mod:`~dptrain.runner.divergence`)
and says when the loop calls it; see :mod:`dptrain.runner.hooks` for the moments of a step.
"""

from __future__ import annotations

import torch

from dptrain.api.engine import Engine, StepInfo
from dptrain.launch.heartbeat import Heartbeat
from dptrain.runner.divergence import DivergenceMonitor
from dptrain.runner.faults import inject_fault
from dptrain.runner.hooks import StepHook
from dptrain.runner.metrics import StepTimes
from dptrain.runner.report import RunLog
from dptrain.runner.skips import SkipBound
from dptrain.runner.straggler import Straggler

__all__ = ["HeartbeatHook", "FaultHook", "StragglerHook", "SkipHook", "DivergenceHook"]


class HeartbeatHook(StepHook):
    """Marks each step's start for the watchdog (``launch.heartbeat``); stops watching once the steps are done:
    the end's collectives and gloo's timeout still bound what follows."""

    def __init__(self, beat: Heartbeat):
        self.beat = beat

    def begin_step(self, step: int) -> None:
        self.beat.mark(step)

    def at_end(self, step: int) -> None:
        self.beat.disarm()


class FaultHook(StepHook):
    """``DPTRAIN_FAULT=<rank>:<step>:<kind>``: this rank's injected fault, at the start of that step."""

    def __init__(self, fault: tuple[int, int, str], rank: int, model: torch.nn.Module):
        self.fault, self.rank, self.model = fault, rank, model

    def begin_step(self, step: int) -> None:
        if self.fault[:2] == (self.rank, step):
            inject_fault(self.fault[2], self.rank, step, self.model)


class StragglerHook(StepHook):
    """``[straggler]``: this rank computes ``factor`` times slower; its sleep comes after the step's first
    forward, inside the forward span, as a slow device's compute would."""

    def __init__(self, straggler: Straggler):
        self.straggler = straggler

    def after_first_forward(self) -> None:
        self.straggler.delay()

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        # forward and backward, less the wait for gradients at the end of backward
        compute = sum(e - s for s, e in times.forward + times.backward) - times.exposed_comm_s
        self.straggler.step_done(compute)


class SkipHook(StepHook):
    """``train.max_skipped_steps``: a run that skips step after step (non-finite gradients) ends with exit 1."""

    def __init__(self, limit: int, engine: Engine, start_step: int):
        self.engine, self.start_step = engine, start_step
        self.bound = SkipBound(limit, engine.skipped_steps)

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        self.bound.check(step, self.engine.skipped_steps)

    def at_end(self, step: int) -> None:
        self.bound.check_end(step - self.start_step)


class DivergenceHook(StepHook):
    """``[divergence]``: every ``every`` steps, the replicas compared bit for bit (collective)."""

    def __init__(self, monitor: DivergenceMonitor, every: int, log: RunLog):
        self.monitor, self.every, self.log = monitor, every, log

    def after_step(self, step: int, info: StepInfo, times: StepTimes) -> None:
        if step % self.every:
            return
        found = self.monitor.check(step)  # raises DivergenceError on every rank unless repair is on
        if found:
            self.log.info(f"warning: replicas diverged at step {step}: {found.tensor} differs first "
                          f"({found.differing} tensors), rank(s) {found.bad_ranks} off the majority; repaired "
                          f"from rank {found.source}")
