"""DiLoCo's outer steps on a schedule: one over the whole model every H steps, or Streaming DiLoCo's fragments.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication"), with the semantics of torchft's ``DiLoCo(fragment_sync_delay,
fragment_update_alpha)``: the trained parameters are split into P fragments
(:mod:`dptrain.diloco.fragments`), each with its own global weights and outer optimizer
(:class:`~dptrain.diloco.outer.OuterStep`). With a slot of S = H / P inner steps and an
overlap of tau < S steps, counting inner steps ``t = 1, 2, ...`` after the warm-up:

- at ``t = k S - tau`` fragment ``f = (k - 1) mod P`` takes its pseudo-gradient
  (``global_f - replica_f``) and starts its reduction;
- at ``t = k S`` the reduction has had tau inner steps to run; the outer step lands on
  ``global_f``, and the replica's fragment becomes ``alpha * replica_f + (1 - alpha) *
  global_f`` (``mixing``; 0: the global weights, torchft's default).

So every fragment meets every H steps, one fragment every S steps, each sync point
sending 1/P of the model, and at most one reduction is in flight. With P = 1, tau = 0 and
alpha = 0 it is DiLoCo's outer step every H steps. A checkpoint taken while
a reduction is in flight waits for it and keeps its mean (the same on every rank), so a
resumed run lands it at the same step, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dptrain.diloco.options import DiLoCoOptions
from dptrain.diloco.outer import InFlight, OuterStep, RoundDelta, make_compressor

__all__ = ["Schedule", "MetRound"]


@dataclass
class MetRound:
    """A live round's reduction, waited for: each fragment's averaged pseudo-gradient, whether it is the meeting after
    the run's last step (no mixing then), and when the wait began (the sync's time runs from it)."""

    reduced: list[tuple[int, RoundDelta]]
    last: bool
    t0: float


class Schedule:
    """The fragments' outer steps (one fragment: DiLoCo's) and the reduction in flight (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], fragments: list[list[int]], options: DiLoCoOptions,
                 home: torch.device | str, process_group: dist.ProcessGroup | None, *, lr: float, step: int):
        """Collective (the ranks' fragments are compared, and a compressor opens its channel). ``lr``: the outer
        learning rate; ``step``: the step count now, where every fragment's global weights start."""
        o = options
        self.index = fragments
        self.slot, self.overlap, self.keep = o.period // len(fragments), o.overlap_steps, o.mixing
        _check_same_fragments(params, fragments, process_group)
        # one compressor for every fragment (its channel is one process group), each fragment its own key
        self.compressor = make_compressor(o.compression, o.error_feedback, process_group)
        self.outers = [OuterStep([params[i] for i in members], lr=lr, momentum=o.outer_momentum,
                                 nesterov=o.nesterov, home=home, process_group=process_group,
                                 compressor=self.compressor, key=f) for f, members in enumerate(fragments)]
        self.flight: tuple[int, InFlight] | None = None
        self.due = 0  # the inner step after which the reduction in flight lands
        self.landed = [step] * len(fragments)  # the step count at each fragment's last outer step

    def set_lr(self, lr: float) -> None:
        """Every fragment's outer learning rate."""
        for outer in self.outers:
            for group in outer.optimizer.param_groups:
                group["lr"] = lr

    def members(self, params: list[nn.Parameter], f: int) -> list[nn.Parameter]:
        return [params[i] for i in self.index[f]]

    def starts(self, local: int) -> int | None:
        """The fragment whose pseudo-gradient is taken after inner step ``local`` (1, 2, ...), or None."""
        k, rest = divmod(local + self.overlap, self.slot)
        return (k - 1) % len(self.outers) if rest == 0 and k >= 1 else None

    def lands(self, local: int) -> bool:
        """Whether the reduction in flight lands after inner step ``local``."""
        return local >= self.slot and local % self.slot == 0

    def start(self, f: int, params: list[nn.Parameter], step: int, due: int) -> list[dict[str, int]]:
        """Collective: fragment ``f``'s reduction launched at step count ``step``, to land after inner step ``due``;
        the bytes of one still in flight, landed first (a schedule resumed with less overlap than it was saved
        with: one reduction at a time)."""
        earlier = [self.land(params, step)] if self.flight is not None else []
        self.flight, self.due = (f, self.outers[f].start(self.members(params, f))), due
        return earlier

    def land(self, params: list[nn.Parameter], step: int, keep: float | None = None) -> dict[str, int]:
        """The reduction in flight waited for and its outer step applied at step count ``step`` (mixing by ``keep``,
        or the schedule's); its bytes."""
        f, flight = self.flight
        self.flight = None
        delta, counted = flight.wait()
        self.outers[f].apply(delta, self.members(params, f), keep=self.keep if keep is None else keep)
        self.landed[f] = step
        return counted

    def unmet(self, step: int) -> list[int]:
        """The fragments with steps taken since their last outer step, at step count ``step`` (one in flight among
        them)."""
        return [f for f, landed in enumerate(self.landed) if step > landed]

    def close(self, params: list[nn.Parameter], step: int) -> list[dict[str, int]]:
        """Collective, at the end of training (step count ``step``): the reduction in flight lands as the schedule
        lands it, then every fragment with steps since its last outer step takes one, with no mixing, and the replica
        becomes the global weights. Nothing to do (a second call, or a last step that was a meeting): nothing sent."""
        counted = [self.land(params, step)] if self.flight is not None else []
        for f in self.unmet(step):
            self.start(f, params, step, self.due)
            counted.append(self.land(params, step, keep=0.0))
        return counted

    # ------------------------------------------------------------------ live recovery's meetings

    def meeting_fragments(self, local: int, last: bool) -> list[int]:
        """The fragments a live meeting after inner step ``local`` holds: the slot's one (as :meth:`starts` with no
        overlap), and after the run's last step every fragment, each with steps since its last outer step but the
        slot's (which lands now). From the step alone, so that a member restarted with no schedule of its own
        reduces the same fragments as the others."""
        if last:
            return list(range(len(self.outers))) if local > 0 else []
        return [(local // self.slot - 1) % len(self.outers)] if local >= self.slot and local % self.slot == 0 else []

    def launch_over(self, fragments: list[int], params: list[nn.Parameter], group, participants: int,
                    participating: bool) -> Callable[[], list[tuple[int, RoundDelta]]]:
        """Live recovery's reduction of ``fragments`` over a round's ``group`` (:meth:`OuterStep.launch_over`),
        launched; the function returned waits for it. Nothing applied."""
        launched = [(f, self.outers[f].launch_over(self.members(params, f), group, participants, participating))
                    for f in fragments]

        def wait() -> list[tuple[int, RoundDelta]]:
            try:
                return [(f, under_way.wait()) for f, under_way in launched]
            except Exception:  # a member gone: the residuals as before the round (the first fragment's copy)
                if launched:
                    f, first = launched[0]
                    self.outers[f].restore_residual(first.residual)
                raise
        return wait

    def apply_over(self, reduced: list[tuple[int, RoundDelta]], params: list[nn.Parameter], step: int,
                   last: bool) -> list[dict[str, int]]:
        """A committed round's outer steps at step count ``step`` (mixing by the schedule's factor; after the last step
        none, as :meth:`close`); each one's bytes."""
        for f, r in reduced:
            self.outers[f].apply(r.delta, self.members(params, f), keep=0.0 if last else self.keep)
            self.landed[f] = step
        return [r.counted for _, r in reduced]

    def restore(self, reduced: list[tuple[int, RoundDelta]]) -> None:
        """An aborted round: the error-feedback residuals as they were before it (the fragments share one compressor,
        and the first fragment's copy is the state from before the round)."""
        if reduced:
            f, first = reduced[0]
            self.outers[f].restore(first)

    def global_params(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The global weights, one tensor per trained parameter in ``params`` order, shaped like it (views into the
        fragments' flat weights, where they live)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(params)
        for outer, members in zip(self.outers, self.index, strict=True):
            for i, piece in zip(members, outer.weights.split(outer.sizes), strict=True):
                out[i] = piece.view_as(params[i])
        return out

    def set_global(self, params: list[nn.Parameter]) -> None:
        """Every fragment's global weights become the replica's ``params`` (the outer momentum kept)."""
        for f, outer in enumerate(self.outers):
            outer.weights.copy_(torch.cat([p.detach().reshape(-1) for p in self.members(params, f)]).to(outer.weights))

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Every fragment's global weights and outer momentum, and the reduction in flight, waited for: its fragment,
        mean and bytes (the same on every rank)."""
        state: dict = {"outer": self.outers[0].state_dict() if len(self.outers) == 1 else
                       [outer.state_dict() for outer in self.outers], "landed": list(self.landed)}
        if self.flight is not None:
            f, flight = self.flight
            delta, counted = flight.wait()
            state["flight"] = {"fragment": f, "delta": delta.clone(), "counted": dict(counted)}
        return state

    def load_state_dict(self, state: dict, lr: float, synced_steps: int) -> None:
        """The fragments' global weights and outer momentum, at this run's outer learning rate ``lr``, and the
        reduction in flight; a checkpoint written before the landings were recorded: all at ``synced_steps``."""
        outers = state["outer"] if isinstance(state["outer"], list) else [state["outer"]]
        if len(outers) != len(self.outers):
            raise ValueError(f"the checkpoint's DiLoCo has {len(outers)} fragment(s), this run {len(self.outers)}: "
                             f"resume with diloco.fragments = {len(outers)}")
        for outer, saved in zip(self.outers, outers, strict=True):
            outer.load_state_dict(saved)
        self.set_lr(lr)
        self.landed = [int(s) for s in state.get("landed", [synced_steps] * len(self.outers))]
        flight = state.get("flight")
        self.flight = None if flight is None else (int(flight["fragment"]), InFlight(
            flight["delta"].clone(), lambda: {}, counted={k: int(v) for k, v in flight["counted"].items()}))

    def residual(self) -> dict | None:
        """This rank's error-feedback residuals (every fragment's), or None uncompressed."""
        return self.compressor.state_dict() if self.compressor is not None else None

    def load_residual(self, state: dict | None) -> None:
        if self.compressor is not None and state is not None:
            self.compressor.load_state_dict(state)


def _check_same_fragments(params: list[nn.Parameter], fragments: list[list[int]],
                          group: dist.ProcessGroup | None) -> None:
    """Collective: every rank's fragments hold the same numbers of elements, or a ValueError on every rank (a
    ``fragment_of`` that answers differently on another rank would otherwise hang the first outer step)."""
    sizes = torch.tensor([sum(params[i].numel() for i in members) for members in fragments], dtype=torch.int64,
                         device=params[0].device)
    everyone = [torch.empty_like(sizes) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, sizes, group=group)
    if any(not torch.equal(other, sizes) for other in everyone):
        raise ValueError(f"DiLoCo's fragments differ between ranks (elements per fragment, rank by rank: "
                         f"{[other.tolist() for other in everyone]}): the split must answer alike on every rank (a "
                         "fragment_of from the parameter's name alone, not hash(), which differs between processes)")
