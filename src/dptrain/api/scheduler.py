"""``prepare()``'s LR scheduler: how many times it steps per optimizer step, and the count per epoch before prepare.

A script written for one process builds its schedule over the loader it has:
``CosineAnnealingLR(T_max=epochs * len(loader))``, before ``prepare()``. Once prepared,
each of ``N`` ranks takes a 1/N shard of every epoch, so the run takes about ``N``
times fewer optimizer steps, each on ``N`` times the samples. Stepped once per optimizer
step the schedule would stop a 1/N of the way along (at world 2 a cosine from 3e-3 ends
at 1.5e-3). So by default (``scheduler_steps="per_process"``, Accelerate's rule: its
``AcceleratedScheduler`` with ``split_batches=False``) the scheduler steps ``N`` times
per optimizer step, once per process: the schedule advances by the per-rank batches
the step consumed, and a schedule written for one process over the loader you passed
ends where the script meant it to. ``scheduler_steps="per_step"`` steps it once per
optimizer step, for a schedule written in the run's own optimizer steps.

Either way the scheduler steps only when an accumulation window closes (a schedule
counts optimizer steps, not micro-steps: ``T_max = epochs x ceil(len(loader) /
grad_accum_steps)`` for one process), and not at all when the optimizer skipped a
non-finite step. Its state is the wrapped scheduler's own (``last_epoch`` counts its
steps), so saving and loading it resumes it; the rule itself keeps no state.

Exact or not: ``N x`` the optimizer steps of a shard's epoch equals one process's count
when the data set splits evenly into ``N x batch_size``; otherwise each rank's shard is
padded to equal length and a little more is stepped per epoch (a few steps).
:func:`~dptrain.api.prepare.scheduler_steps_per_epoch` gives the exact count before
``prepare()``, for either rule. A ``OneCycleLR`` is never stepped past ``total_steps`` (it would raise; Accelerate
stops it too), and a scheduler stepped past the end of its schedule (``T_max``,
``total_steps``, ``total_iters`` of a ``PolynomialLR``) warns once with the numbers, the
sign of a schedule written in the other rule's units. ``ReduceLROnPlateau`` counts
evaluations, not samples: it steps once per call.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler, OneCycleLR, PolynomialLR, ReduceLROnPlateau

__all__ = ["PreparedScheduler", "steps_per_optimizer_step", "schedule_end", "SCHEDULER_STEPS"]

SCHEDULER_STEPS = ("per_process", "per_step")


def steps_per_optimizer_step(scheduler_steps: str, world_size: int) -> int:
    """How many times a prepared scheduler steps per optimizer step: ``world_size`` per process, or 1."""
    if scheduler_steps not in SCHEDULER_STEPS:
        raise ValueError(f"scheduler_steps must be 'per_process' (once per process per optimizer step, Accelerate's "
                         f"rule: a schedule written for one process) or 'per_step' (once per optimizer step: a "
                         f"schedule in this run's optimizer steps), got {scheduler_steps!r}")
    return world_size if scheduler_steps == "per_process" else 1


class PreparedScheduler:
    """The LR scheduler, stepped ``per_step`` times when an accumulation window closes, unless the optimizer skipped.

    As Accelerate's AcceleratedScheduler (which also lets it precede ``optimizer.step()``);
    ``per_step`` is ``world_size`` by default (see the module docstring). Without a
    prepared optimizer: whenever a window closes.
    """

    def __init__(self, scheduler: LRScheduler, optimizer: Any, state: Any, per_step: int = 1):
        self.scheduler, self.optimizer, self.accumulation = scheduler, optimizer, state
        self.per_step = 1 if isinstance(scheduler, ReduceLROnPlateau) else per_step
        self._warned = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        optimizer = self.optimizer
        state = optimizer.accumulation if optimizer is not None else self.accumulation
        if not state.sync_gradients or (optimizer is not None and optimizer.step_was_skipped):
            return
        for _ in range(self.per_step):
            end = schedule_end(self.scheduler)
            if isinstance(self.scheduler, OneCycleLR) and self.scheduler.last_epoch >= end[1]:
                self._warn_past(end, "is at the end of its schedule and stays there (one more step would raise)")
                return
            self.scheduler.step(*args, **kwargs)
            if end is not None and self.scheduler.last_epoch > end[1]:
                self._warn_past(end, "was stepped past the end of its schedule")

    def _warn_past(self, end: tuple[str, int], what: str) -> None:
        if self._warned:
            return
        self._warned = True
        name, last = type(self.scheduler).__name__, self.scheduler.last_epoch
        if self.per_step > 1:
            rule = (f"prepare() steps it {self.per_step} times per optimizer step (once per process, Accelerate's "
                    f"rule), so {end[0]} counts one process's steps over the loader as you passed it: epochs x "
                    "ceil(len(loader) / grad_accum_steps). A schedule in this run's own optimizer steps needs "
                    "prepare(..., scheduler_steps='per_step')")
        else:
            rule = f"prepare() steps it once per optimizer step, so {end[0]} counts this run's optimizer steps"
        warnings.warn(f"{name} {what} ({end[0]}={end[1]}; stepped {last} times) while training goes on. {rule}. "
                      "dptrain.scheduler_steps_per_epoch(loader, grad_accum_steps=...), called before prepare(), "
                      "gives the exact count per epoch", stacklevel=3)

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, last_epoch, ...
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def schedule_end(scheduler: LRScheduler) -> tuple[str, int] | None:
    """(argument, steps) where ``scheduler``'s schedule ends, for the schedulers that have an end; else None."""
    for kind, argument in ((CosineAnnealingLR, "T_max"), (OneCycleLR, "total_steps"), (PolynomialLR, "total_iters")):
        if isinstance(scheduler, kind):
            return argument, int(getattr(scheduler, argument))
    return None
