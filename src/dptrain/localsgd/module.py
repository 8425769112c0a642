"""Post-local SGD (Lin et al. 2020, "Don't use large mini-batches, use local SGD"): synchronous DDP steps for a
warm-up, then every rank steps alone on its own gradients and the replicas are averaged every ``period`` steps.

With H = ``period``, a rank sends its model once every H steps instead of its gradients
every step (H times fewer bytes), at the cost of replicas that drift apart between
averages. Lin et al. warm up synchronously first: local steps from the first step hurt
the final accuracy, after a warm-up they generalise as well or better.

The schedule is torch's (``PostLocalSGDState(start_localSGD_iter=warmup_steps)`` with a
``PeriodicModelAverager(period, warmup_steps)``): optimizer steps ``s = 0, 1, ...`` below
``warmup_steps`` all-reduce their gradients (the DDP engine, bit for bit a ddp run's);
from ``warmup_steps`` on, gradients stay local, and after step ``s`` the parameters are
averaged when ``(s - warmup_steps) % period == 0`` (so right after the first local step,
then every ``period`` steps). With ``period`` 1 every step's models are averaged: with
plain SGD, the same step as DDP's to rounding. Unlike torch's averager, the step count is
part of the wrapper's checkpoint state: a resumed run does not restart its warm-up
(pytorch issue 74556). Only parameters are averaged; buffers stay each rank's, as torch's.

The wrapper satisfies the strategies' wrapper protocol (``strategies/protocol.py``): the
averaging hangs on :meth:`LocalSGD.after_optimizer_step`, which every rank calls after
every optimizer step, skipped ones included, so the ranks' counts never part.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain import comm
from dptrain.comm.average import broadcast_buffers_, consensus_state_dict
from dptrain.ddp import DistributedDataParallel
from dptrain.ddp.warmup import SyncWarmup
from dptrain.localsgd.average import average_parameters
from dptrain.localsgd.options import LocalSGDOptions
from dptrain.utils.weights_file import save_replica_weights

__all__ = ["LocalSGD"]


class LocalSGD(SyncWarmup, nn.Module):
    """``module`` trained by post-local SGD over ``process_group`` (see the module docstring).

    ``options``: a :class:`LocalSGDOptions`; or its fields as keywords (``period=``,
    ``warmup_steps=``, ``ddp=``).
    """

    def __init__(self, module: nn.Module, options: LocalSGDOptions | None = None,
                 process_group: dist.ProcessGroup | None = None, **keywords: Any):
        super().__init__()
        if options is not None and keywords:
            raise TypeError(f"pass LocalSGDOptions or its fields as keywords, not both (got {sorted(keywords)})")
        self.options = options if options is not None else LocalSGDOptions(**keywords)
        self.ddp = DistributedDataParallel(module, process_group=process_group, **self.options.ddp)
        self.process_group, self.device = process_group, self.ddp.device
        self.steps = 0  # optimizer steps taken, skipped ones included: the same count on every rank
        self.averages = 0
        self.averaged_steps = 0  # the step count at the last average
        self.meets_itself = True  # False under live recovery, which holds the averages (the meeting protocol)
        self.last_average_s = 0.0
        self._bytes = 0         # averaged since the last step_metrics()
        self._metered_steps = 0
        self._metered_averages = 0
        params = self._params()
        self._sent_per_average = comm.sent_bytes("all_reduce", sum(p.numel() for p in params),
                                                 params[0].element_size(), group=process_group) if params else 0

    @property
    def module(self) -> nn.Module:
        """The model as the user built it."""
        return self.ddp.module

    @property
    def local_steps(self) -> int:
        """Local steps since the replicas were last averaged (0: they are equal)."""
        local = self.steps - self.options.warmup_steps
        return 0 if local <= 0 else (local - 1) % self.options.period

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._warmup_forward(*inputs, **kwargs)

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ the wrapper protocol

    def record_comm_spans(self, on: bool) -> None:
        self.ddp.record_comm_spans(on)

    def before_optimizer_step(self) -> None:
        """Nothing: a local step applies this rank's own gradient."""

    def after_optimizer_step(self) -> None:
        """Count the step; average the replicas when the schedule says so (collective then)."""
        self.steps += 1
        self._metered_steps += 1
        if self.meets_itself and self.meeting_due:
            self.average()

    def average(self) -> None:
        """Collective: every replica becomes the mean of all of them."""
        t0 = time.perf_counter()
        self._count(average_parameters(self._params(), self.process_group), t0)

    def _count(self, reduced_bytes: int, t0: float) -> None:
        self._bytes += reduced_bytes
        self.averages += 1
        self._metered_averages += 1
        self.averaged_steps = self.steps
        self.last_average_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ the meeting protocol (live recovery)

    @property
    def meeting_due(self) -> bool:
        """Whether the schedule averages after the step just taken (the first local step, then every ``period``)."""
        local = self.steps - 1 - self.options.warmup_steps
        return self.unmet_steps > 0 and local >= 0 and local % self.options.period == 0

    @property
    def unmet_steps(self) -> int:
        """Local steps since the replicas were last averaged (0 in the warm-up)."""
        return max(0, self.steps - max(self.averaged_steps, self.options.warmup_steps))

    def hold_meetings(self, replicas: int) -> None:
        """Live recovery holds the averages from now (the meeting protocol); the average counts no replicas."""
        self.meets_itself = False

    def skip_steps(self, steps: int) -> None:
        """``steps`` local steps counted, not taken: a member healed after the last meeting sits out the steps to the
        next (the others take them), and meets adding nothing."""
        self.steps += steps

    meeting_overlap = 0  # a meeting's average runs at the meeting, beside no steps

    def meeting_starts(self, step: int) -> bool:
        """Never: an average is not overlapped with steps."""
        return False

    @torch.no_grad()
    def launch_meeting(self, group: dist.ProcessGroup | None, participants: int, participating: bool, step: int,
                       last: bool) -> Callable[[], torch.Tensor]:
        """The replicas' mean over a live round's ``group`` (a process group outside torch.distributed's world;
        None: a round of one) and its ``participants`` (a member healed in this round adds zeros: it holds a peer's
        replica), into a flat buffer, launched; the function returned waits for it. Nothing applied. Every meeting
        averages the whole model (``step``, ``last``: which meeting, the same)."""
        self._meeting_t0 = time.perf_counter()
        params = self._params()
        flat = torch.cat([p.detach().reshape(-1) for p in params]) if participating else \
            torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        work = group.allreduce([flat]) if group is not None and group.size() > 1 else None

        def done() -> torch.Tensor:
            if work is not None:
                work.wait()
            return flat.div_(participants)
        return done

    @torch.no_grad()
    def apply_meeting(self, mean: torch.Tensor) -> None:
        """The round committed: every replica becomes the mean."""
        params = self._params()
        torch._foreach_copy_(params, [piece.view_as(p) for piece, p in
                                      zip(mean.split([p.numel() for p in params]), params, strict=True)])
        self._count(mean.numel() * mean.element_size(), self._meeting_t0)

    def discard_meeting(self, mean: torch.Tensor) -> None:
        """The round aborted: nothing was changed."""

    def met_tensors(self) -> list[torch.Tensor]:
        """What every replica holds alike after an average: the parameters (buffers and optimizer state are each
        rank's own)."""
        return self._params()

    def step_metrics(self) -> dict[str, Any]:
        """After the warm-up: the averages' bytes per step since the last call (the step's communication), the
        local steps since the last average, and the last average's time; and the fields every strategy that meets
        every few steps reports (``dptrain.runner.metrics``): what its meetings are called, H, how many, and DDP's
        bytes per step to compare with (its all-reduce of the gradients: the parameters' bytes, by the same ring as
        an average's). Not a collective."""
        if self.steps <= self.options.warmup_steps:
            return {}
        steps, self._metered_steps = max(1, self._metered_steps), 0
        (raw, averages), self._bytes, self._metered_averages = (self._bytes, self._metered_averages), 0, 0
        return {"comm_bytes_per_step": raw / steps, "comm_sent_bytes_per_step": averages * self._sent_per_average
                / steps, "comm_compressed_bytes_per_step": 0, "local_steps": self.local_steps,
                "average_ms": 1e3 * self.last_average_s,
                "sync_name": "averaging round", "sync_period": self.options.period, "syncs": self.averages,
                "steps_since_sync": self.unmet_steps,
                "gradient_bytes": sum(p.numel() * p.element_size() for p in self._params()),
                "gradient_sent_bytes": self._sent_per_average}

    def finish(self) -> None:
        """Collective, after the last step: the replicas averaged if they differ (the model to evaluate and keep);
        after the warm-up, buffers are rank 0's on every rank."""
        if self.unmet_steps:
            self.average()
        if self.steps > self.options.warmup_steps:
            broadcast_buffers_(self.module, self.process_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the replicas' mean, as :meth:`finish` would leave them, on a copy."""
        return consensus_state_dict(self.module, self.process_group)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank loads the same state: the replicas are equal again."""
        self.module.load_state_dict(state)

    def evaluating(self) -> contextlib.AbstractContextManager[nn.Module]:
        """This rank's replica (an evaluation averages the replicas' losses; the model kept is their mean)."""
        return contextlib.nullcontext(self.module)

    def export_weights(self, path) -> Path | None:
        """Rank 0 writes its replica's state dict (after :meth:`finish`, every replica's)."""
        return save_replica_weights(self.module, path)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """``shared``: the step count (the schedule's position); ``rank``: once the warm-up is over, this rank's
        own replica and optimizer state (they differ between ranks from then on)."""
        state: dict[str, dict] = {"shared": {"steps": self.steps, "averages": self.averages,
                                             "averaged_steps": self.averaged_steps}}
        if self.steps > self.options.warmup_steps:
            state["rank"] = {"model": self.module.state_dict(), "optimizer": optimizer.state_dict()}
        return state

    def heal_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """All of :meth:`checkpoint_state` (nothing in it is dropped at a meeting)."""
        return self.checkpoint_state(optimizer)

    def load_checkpoint_state(self, state: dict[str, dict | None], optimizer: torch.optim.Optimizer) -> str | None:
        """Continue the schedule where it was; take this rank's own replica back where it was saved (on as many
        ranks). Returns what to tell the user when the replicas start from rank 0's instead."""
        shared = state.get("shared") or {}
        self.steps, self.averages = int(shared.get("steps", 0)), int(shared.get("averages", 0))
        self.averaged_steps = int(shared.get("averaged_steps", self.steps - self.local_steps))
        mine = state.get("rank")
        if mine:
            self.module.load_state_dict(mine["model"])
            optimizer.load_state_dict(mine["optimizer"])
            return None
        if self.steps > self.options.warmup_steps:
            return ("local SGD's replicas start from rank 0's copy and optimizer state: the checkpoint has none "
                    "for this rank (saved on another number of ranks)")
        return None
