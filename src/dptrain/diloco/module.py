"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"): each rank
takes H steps of the run's optimizer alone (the inner steps), then the ranks meet once, for the outer step.

The ranks send their weights' difference once every H steps instead of their gradients
every step: H times fewer bytes (4H with int8), and one meeting per H steps, which is
what makes it train over slow links between machines. The price is the ranks' drift
between meetings, which the outer optimizer's Nesterov momentum partly turns into speed.

With ``warmup_steps``, the first steps are the DDP engine's (gradients all-reduced every
step, the replicas equal), and the global weights start where the warm-up ends: the paper
starts DiLoCo from a model trained synchronously, where the loss has left its first,
steepest phase, in which the replicas' drift costs the most.

The wrapper keeps the global weights and the outer optimizer's momentum off the compute
device (``offload``, on the CPU: they are touched once every H steps), as torchft's and
OpenDiLoCo's do; each rank keeps its own inner optimizer state across rounds, as in the
paper. The rounds hang on :meth:`DiLoCo.after_optimizer_step`, which every rank calls after
every optimizer step (skipped ones included), so the ranks meet at the same steps; the
outer step itself is :class:`~dptrain.diloco.outer.OuterStep`.

Between meetings the replicas differ: an evaluation runs on the global weights
(:meth:`DiLoCo.evaluating`), the model the outer steps train, and :meth:`DiLoCo.finish`
ends a run with an outer step when its last round is incomplete, so that the model kept
is the global one. A checkpoint holds the global
weights, the outer momentum and the step count (the same on every rank) and each rank's
own replica, inner optimizer state and error-feedback residual, so that a run resumed in
the middle of a round continues bit for bit.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.comm.average import broadcast_buffers_, consensus_state_dict
from dptrain.ddp import DistributedDataParallel
from dptrain.ddp.warmup import SyncWarmup
from dptrain.diloco.fragments import split_fragments
from dptrain.diloco.options import DiLoCoOptions
from dptrain.diloco.outer import OuterStep
from dptrain.diloco.streaming import MetRound, Schedule
from dptrain.utils.weights_file import save_replica_weights

__all__ = ["DiLoCo"]


class DiLoCo(SyncWarmup, nn.Module):
    """``module`` trained by DiLoCo over ``process_group`` (see the module docstring).

    ``options``: a :class:`DiLoCoOptions`, or its fields as keywords (``period=``, ``outer_lr=``...).
    """

    def __init__(self, module: nn.Module, options: DiLoCoOptions | None = None,
                 process_group: dist.ProcessGroup | None = None, **keywords: Any):
        super().__init__()
        if options is not None and keywords:
            raise TypeError(f"pass DiLoCoOptions or its fields as keywords, not both (got {sorted(keywords)})")
        self.options = options if options is not None else DiLoCoOptions(**keywords)
        self.process_group = process_group
        # The DDP engine for the warm-up (it broadcasts rank 0's weights, so the replicas start equal); without
        # one, the module itself, broadcast here.
        self.ddp = DistributedDataParallel(module, process_group=process_group, **self.options.ddp) \
            if self.options.warmup_steps else None
        if self.ddp is None:
            self._module = module
            _broadcast_from_rank0(module, process_group)
        self.device = next(module.parameters()).device
        o = self.options
        self.fragments = split_fragments(self.module, self._params(), o.fragments, o.fragment_pattern, o.fragment_of)
        self.replicas = dist.get_world_size(process_group)  # what the default outer learning rate counts
        self.steps = 0  # optimizer steps taken, skipped ones included: the same count on every rank
        self.schedule = self._fresh_schedule()
        self.syncs = 0
        self.synced_steps = 0  # the step count at the last outer step
        self.meets_itself = True  # False under live recovery, which holds the outer steps (the meeting protocol)
        self.last_sync_s = 0.0
        self.peak_sync_sent = 0  # the most bytes one sync point sent
        self._metered = {"steps": 0, "raw": 0, "payload": 0, "sent": 0}

    @property
    def module(self) -> nn.Module:
        """The model as the user built it."""
        return self.ddp.module if self.ddp is not None else self._module

    def _fresh_schedule(self) -> Schedule:
        """The outer steps from the replicas' weights now (collective where it compresses: its channel)."""
        return Schedule(self._params(), self.fragments, self.options, "cpu" if self.options.offload else self.device,
                        self.process_group, lr=self.options.lr_for(self.replicas), step=self.steps)

    def hold_meetings(self, replicas: int) -> None:
        """Live recovery holds the outer steps from now (the meeting protocol) over a job of ``replicas`` workers,
        which the default outer learning rate counts (each worker's own process group is itself alone)."""
        self.meets_itself = False
        self.replicas = replicas
        self.schedule.set_lr(self.options.lr_for(replicas))
        self.schedule.flight = None  # resumed from a checkpoint without live recovery: its meeting lands it afresh

    @property
    def outer(self) -> OuterStep:
        """The outer step of the whole model (one fragment: the meeting protocol's, which live recovery holds)."""
        return self.schedule.outers[0]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.ddp is None:
            return self._module(*inputs, **kwargs)
        return self._warmup_forward(*inputs, **kwargs)

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def local_steps(self) -> int:
        """Inner steps since the warm-up (0 in it)."""
        return max(0, self.steps - self.options.warmup_steps)

    @property
    def steps_since_sync(self) -> int:
        """Inner steps since the last sync point (an outer step, or a fragment's; 0 in the warm-up and right after
        one)."""
        return self.local_steps % self.schedule.slot

    # ------------------------------------------------------------------ the wrapper protocol

    def record_comm_spans(self, on: bool) -> None:
        """The warm-up's buckets, as the DDP engine records them; an outer step is timed whole (``sync_ms``)."""
        if self.ddp is not None:
            self.ddp.record_comm_spans(on)

    def before_optimizer_step(self) -> None:
        """Nothing: the inner step applies this rank's own gradient."""

    def after_optimizer_step(self) -> None:
        """Count the step; at the warm-up's end the global weights start from the replicas (all equal); then
        every ``period`` inner steps, the outer step (collective)."""
        self.steps += 1
        if self.steps <= self.options.warmup_steps:
            if self.steps == self.options.warmup_steps:
                self.schedule = self._fresh_schedule()
            return
        self._metered["steps"] += 1
        if not self.meets_itself:
            return
        t0, local, params = time.perf_counter(), self.local_steps, self._params()
        start, due = self.schedule.starts(local), local + self.options.overlap_steps
        # a reduction resumed from a checkpoint saved with more overlap may already be the one for this landing
        if start is not None and not (self.schedule.flight is not None and self.schedule.due == due):
            for counted in self.schedule.start(start, params, self.steps, due):
                self._count(counted, t0)
        if self.schedule.lands(local):
            if self.schedule.flight is None:  # resumed with more overlap than saved with: the slot's, unoverlapped
                self.schedule.start((local // self.schedule.slot - 1) % len(self.fragments), params, self.steps,
                                    local)
            self._count(self.schedule.land(params, self.steps), t0)

    def _count(self, counted: dict[str, int], t0: float) -> None:
        for key, value in counted.items():
            self._metered[key] += value
        self.peak_sync_sent = max(self.peak_sync_sent, counted["sent"])
        self.syncs += 1
        self.synced_steps = self.steps
        self.last_sync_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ the meeting protocol (live recovery)

    @property
    def meeting_due(self) -> bool:
        """Whether the schedule holds an outer step after the step just taken (every ``period`` inner steps)."""
        return self.unmet_steps > 0 and self.steps_since_sync == 0

    @property
    def unmet_steps(self) -> int:
        """Inner steps since the last outer step (0 in the warm-up)."""
        return 0 if self.in_warmup else self.steps - max(self.synced_steps, self.options.warmup_steps)

    def skip_steps(self, steps: int) -> None:
        """``steps`` inner steps counted, not taken: a member healed after the last meeting sits out the steps to the
        next (the others take them), and meets adding nothing."""
        self.steps += steps

    @property
    def meeting_overlap(self) -> int:
        """Inner steps a meeting's reduction runs beside before it lands (Streaming DiLoCo's tau; 0: none)."""
        return self.options.overlap_steps

    def meeting_starts(self, step: int) -> bool:
        """Whether, with an overlap, a meeting's reduction starts after step count ``step`` (:meth:`Schedule.starts`),
        to land ``meeting_overlap`` steps on."""
        local = step - self.options.warmup_steps
        return bool(self.options.overlap_steps) and local > 0 and self.schedule.starts(local) is not None

    def launch_meeting(self, group: dist.ProcessGroup | None, participants: int, participating: bool, step: int,
                       last: bool) -> Callable[[], MetRound]:
        """The outer step's reduction over a live round's ``group`` (:meth:`OuterStep.launch_over`), launched, not
        applied: for the meeting that lands at step count ``step`` the slot's fragment (the whole model without
        fragments), after the ``last`` step every fragment (:meth:`Schedule.meeting_fragments`). The function
        returned waits for it."""
        fragments = self.schedule.meeting_fragments(step - self.options.warmup_steps, last)
        wait = self.schedule.launch_over(fragments, self._params(), group, participants, participating)

        def waited() -> MetRound:
            t0 = time.perf_counter()  # a sync's time: its wait and its apply, not the steps beside it
            return MetRound(wait(), last, t0)
        return waited

    def apply_meeting(self, met: MetRound) -> None:
        """The round committed: the fragments' outer steps with their averaged pseudo-gradients."""
        for counted in self.schedule.apply_over(met.reduced, self._params(), self.steps, met.last):
            self._count(counted, met.t0)  # one sync per fragment, as without live recovery

    def discard_meeting(self, met: MetRound) -> None:
        """The round aborted: nothing changed but the residuals, which go back."""
        self.schedule.restore(met.reduced)

    def met_tensors(self) -> list[torch.Tensor]:
        """What every replica holds alike after a meeting: every fragment's global weights and outer momentum, and
        the weights where every replica restarts from the global ones at each (one fragment, no mixing; Streaming
        DiLoCo's replicas differ in the fragments not synced, and a mixed one keeps part of its own). Each rank's
        inner optimizer state and residual are its own."""
        momentum = [t for outer in self.schedule.outers for state in outer.optimizer.state.values()
                    for t in state.values() if isinstance(t, torch.Tensor)]
        restarted = len(self.fragments) == 1 and not self.options.mixing
        return [*(self._params() if restarted else []), *(outer.weights for outer in self.schedule.outers),
                *momentum]

    def step_metrics(self) -> dict[str, Any]:
        """After the warm-up: bytes per inner step since the last call (what the outer steps sent, spread over the
        steps), the steps since the last outer step, and the last one's time; and the fields every strategy that
        meets every few steps reports (``dptrain.runner.metrics``): what its meetings are called, H, how many, and
        DDP's bytes per step to compare with (its all-reduce of the gradients, in the parameters' dtype, by the
        same ring as the outer step's fp32 one). Not a collective."""
        if self.steps <= self.options.warmup_steps:
            return {}
        m, self._metered = self._metered, {"steps": 0, "raw": 0, "payload": 0, "sent": 0}
        steps = max(1, m["steps"])
        gradient_bytes = sum(p.numel() * p.element_size() for p in self._params())
        outers = self.schedule.outers
        fp32_sent, fp32 = sum(o.sent_bytes for o in outers), sum(4 * o.weights.numel() for o in outers)
        return {"comm_bytes_per_step": m["raw"] / steps, "comm_compressed_bytes_per_step": m["payload"] / steps,
                "comm_sent_bytes_per_step": m["sent"] / steps, "steps_since_sync": self.unmet_steps,
                "outer_steps": self.syncs, "sync_ms": 1e3 * self.last_sync_s, "sync_peak_sent_bytes":
                self.peak_sync_sent, "sync_name": "outer step" if len(outers) == 1 else "fragment outer step",
                "sync_period": self.schedule.slot, "sync_fragments": len(outers), "syncs": self.syncs,
                "gradient_bytes": gradient_bytes,
                "gradient_sent_bytes": fp32_sent * gradient_bytes // max(1, fp32)}

    def finish(self) -> str | None:
        """Collective, after the last step: an incomplete last round ends with its outer step, so every replica holds
        the global weights; buffers are rank 0's on every rank. Says so when it took that outer step."""
        if self.in_warmup:
            return None
        unmet, inner = self.schedule.unmet(self.steps), self.unmet_steps
        t0 = time.perf_counter()
        for counted in self.schedule.close(self._params(), self.steps):
            self._count(counted, t0)
        self._from_global_weights()  # a replica that mixed (mixing > 0) holds the global weights too
        broadcast_buffers_(self.module, self.process_group)
        if not unmet:
            return None
        if len(self.fragments) == 1:
            return (f"DiLoCo closed its last round with an outer step over its {inner} "
                    "inner step(s): the weights kept (model.safetensors) are the global weights after it; the last "
                    "checkpoint holds those before it, so that a longer run resumed from it continues exactly")
        return (f"Streaming DiLoCo closed its last rounds with an outer step on fragment(s) "
                f"{', '.join(map(str, unmet))} (inner steps since their last sync): the weights kept "
                "(model.safetensors) are the global weights after them; the last checkpoint holds those before, so "
                "that a longer run resumed from it continues exactly")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The global weights (as of the last outer step: an inner step since then is not the model yet), with rank
        0's buffers; in the warm-up, the replicas' state (equal)."""
        if self.in_warmup:
            return self.module.state_dict()
        state = consensus_state_dict(self.module, self.process_group, average=False)  # rank 0's buffers
        params = self._params()
        global_of = {id(p): w for p, w in zip(params, self.schedule.global_params(params), strict=True)}
        for key, live in self.module.state_dict(keep_vars=True).items():
            if id(live) in global_of:
                state[key] = global_of[id(live)].to(device=live.device, dtype=live.dtype, copy=True)
        return state

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank: the replicas and the global weights become ``state`` (the outer momentum is kept)."""
        self.module.load_state_dict(state)
        if not self.in_warmup:
            self.schedule.set_global(self._params())

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """The module holding the global weights for the block (the model DiLoCo trains, as the Streaming DiLoCo
        paper evaluates it: the replica is where one rank's inner steps took it), the replica's own back after it.
        Right after an outer step and in the warm-up the two are the same, and nothing is copied. Not a collective:
        each rank swaps its own (the replica is kept where the global weights live, on the CPU with ``offload``)."""
        if self.in_warmup or (not self.unmet_steps and self.schedule.flight is None and len(self.fragments) == 1
                              and not self.options.mixing):
            yield self.module
            return
        params = self._params()
        with torch.no_grad():
            kept = [p.detach().to(self.outer.weights.device, copy=True) for p in params]
        self._from_global_weights()
        try:
            yield self.module
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, kept)

    def export_weights(self, path) -> Path | None:
        """Rank 0 writes its replica's state dict (after :meth:`finish`, every replica's)."""
        return save_replica_weights(self.module, path)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """``shared``: the global weights, the outer momentum and the step count; ``rank``: this rank's replica,
        inner optimizer state and error-feedback residual (all differ between ranks)."""
        return {"shared": {**self.schedule.state_dict(), "steps": self.steps, "syncs": self.syncs,
                           "synced_steps": self.synced_steps, "peak_sync_sent": self.peak_sync_sent},
                "rank": {"model": self.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "residual": self.schedule.residual()}}

    def heal_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """:meth:`checkpoint_state` without the error-feedback residual: it is the sender's own, and a healed member's
        is cleared at the meeting it joins (it adds zeros to it), so it is not sent (live recovery's heal)."""
        state = self.checkpoint_state(optimizer)
        state["rank"]["residual"] = None
        return state

    def load_checkpoint_state(self, state: dict[str, dict | None], optimizer: torch.optim.Optimizer) -> str | None:
        """Continue the round where it was. Without this rank's own part (saved on another number of ranks), the
        rank starts a fresh round from the global weights, with rank 0's inner optimizer state; says so."""
        shared = state.get("shared")
        if shared is None:  # a checkpoint of another strategy: the model loaded is where the global weights start
            self.schedule = self._fresh_schedule()
            return "DiLoCo's global weights start from the checkpoint's model, with no outer momentum yet"
        self.steps, self.syncs = int(shared["steps"]), int(shared["syncs"])
        self.peak_sync_sent = int(shared.get("peak_sync_sent", 0))
        self.synced_steps = int(shared.get("synced_steps", self.steps - self.steps_since_sync))
        self.schedule.load_state_dict(shared, self.options.lr_for(self.replicas), self.synced_steps)
        self.schedule.due = (self.local_steps // self.schedule.slot + 1) * self.schedule.slot  # a flight's landing
        if not self.meets_itself:  # live recovery holds the meetings: the fragment's meeting reduces it afresh there
            self.schedule.flight = None
        mine = state.get("rank")
        if mine:
            self.module.load_state_dict(mine["model"])
            optimizer.load_state_dict(mine["optimizer"])
            self.schedule.load_residual(mine.get("residual"))
            return None
        self._from_global_weights()
        return (f"DiLoCo's ranks continue their round from the global weights (the checkpoint holds no replica for "
                f"this rank: saved on another number of ranks); the {self.steps_since_sync} inner step(s) the "
                "round had taken are lost")

    @torch.no_grad()
    def _from_global_weights(self) -> None:
        params = self._params()
        torch._foreach_copy_(params, [w.to(p.device) for w, p in
                                      zip(self.schedule.global_params(params), params, strict=True)])


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    tensors = [t for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.broadcast(flat, dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    torch._foreach_copy_(tensors, [piece.view_as(t) for piece, t in
                                   zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)])
