"""DiLoCo's outer step (Douillard et al. 2023, Algorithm 1): one all-reduce of the pseudo-gradients, one step of the
outer optimizer on the global weights, every rank restarted from them.

With global weights ``g`` and rank ``i``'s weights ``x_i`` after H inner steps,

    delta_i = g - x_i              (rank i's pseudo-gradient: where its inner steps took it, reversed)
    delta   = mean_i delta_i       (one all-reduce, optionally compressed)
    g       <- OuterSGD(g, delta)  (SGD, Nesterov momentum: the paper's lr 0.7 and momentum 0.9)
    x_i     <- g                   (every rank starts the next round from the same weights)

With H = 1, outer lr 1 and no momentum, ``g <- mean_i x_i``: with plain SGD inside, DDP's step
(to rounding). :class:`OuterStep` packs the weights into one flat buffer (one all-reduce, one
optimizer tensor); :func:`outer_step_naive` does the same per tensor, the oracle in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.comm.cost import collective_cost
from dptrain.compress import make_codec
from dptrain.compress.codecs import Encoded
from dptrain.compress.fourbit import FOUR_BIT
from dptrain.compress.hook import CompressionHook
from dptrain.ddp.comm_hooks import GradBucket
from dptrain.diloco.quantised import QuantisedReduction

__all__ = ["OuterStep", "InFlight", "Launched", "RoundDelta", "make_compressor", "outer_step_naive", "outer_optimizer"]


@dataclass
class InFlight:
    """A pseudo-gradient whose reduction is under way: :meth:`wait` ends it (``delta`` then holds the mean) and
    returns its bytes."""

    delta: torch.Tensor
    done: Callable[[], dict[str, int]]
    counted: dict[str, int] | None = None

    def wait(self) -> tuple[torch.Tensor, dict[str, int]]:
        if self.counted is None:
            self.counted = self.done()
        return self.delta, self.counted


def make_compressor(compression: str, error_feedback: bool, group: dist.ProcessGroup | None) -> Any:
    """None (uncompressed), the DDP hook's compressor (bf16, int8) or a
    :class:`~dptrain.diloco.quantised.QuantisedReduction` (int4, e3m0)."""
    if compression == "none":
        return None
    if compression in FOUR_BIT:
        return QuantisedReduction(FOUR_BIT[compression](), error_feedback)
    return CompressionHook(make_codec(compression), error_feedback=error_feedback, process_group=group)


@dataclass
class Launched:
    """A live round's reduction under way: :meth:`wait` gives its :class:`RoundDelta`; ``residual`` is the
    error-feedback state from before it (restored where the wait fails: :meth:`OuterStep.restore_residual`)."""

    wait: Callable[[], RoundDelta]
    residual: dict | None


@dataclass
class RoundDelta:
    """A pseudo-gradient averaged over a live round, not applied yet: ``counted`` its bytes, ``residual`` the
    error-feedback state from before it (restored if the round aborts)."""

    delta: torch.Tensor
    counted: dict[str, int]
    residual: dict | None


def outer_optimizer(params: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool) -> torch.optim.SGD:
    """The outer optimizer: SGD, with Nesterov momentum when there is momentum (torch refuses Nesterov without)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


class OuterStep:
    """The global weights (a flat copy, on ``home``), the outer optimizer over them, and the pseudo-gradient's
    reduction (uncompressed, or through a codec with error feedback)."""

    def __init__(self, params: Sequence[torch.Tensor], *, lr: float, momentum: float, nesterov: bool,
                 compression: str = "none", error_feedback: bool = True, home: torch.device | str = "cpu",
                 process_group: dist.ProcessGroup | None = None, compressor: Any = None, key: int = 0):
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sizes = [p.numel() for p in params]
        self.weights = torch.cat([p.detach().reshape(-1) for p in params]).to(home, torch.float32, copy=True)
        self.optimizer = outer_optimizer([self.weights], lr, momentum, nesterov)
        # a compressor may be shared by several outer steps (Streaming DiLoCo's fragments), each its own ``key``
        self.compressor = compressor if compressor is not None else \
            make_compressor(compression, error_feedback, process_group)
        self.key = key
        self.sent_bytes = comm.sent_bytes("all_reduce", self.weights.numel(), 4, group=process_group)

    @torch.no_grad()
    def __call__(self, params: Sequence[torch.Tensor]) -> dict[str, int]:
        """Collective: the outer step from the ranks' ``params``, which then hold the new global weights.

        Returns the bytes of the reduction: ``raw`` (the fp32 pseudo-gradient), ``payload`` (encoded; 0
        uncompressed) and ``sent`` (on the wire, by the cost model or the codec's count).
        """
        delta, counted = self.start(params).wait()
        self.apply(delta, params)
        return counted

    @torch.no_grad()
    def start(self, params: Sequence[torch.Tensor]) -> InFlight:
        """Collective: this rank's pseudo-gradient from ``params`` now, its reduction launched, not waited for
        (Streaming DiLoCo overlaps it with the next inner steps); :meth:`InFlight.wait` gives the mean."""
        delta = self.pseudo_gradient(params)
        raw = delta.numel() * delta.element_size()
        if self.compressor is None:
            work = dist.all_reduce(delta, group=self.group, async_op=True)

            def done() -> dict[str, int]:
                work.wait()
                delta.div_(self.world_size)
                return {"raw": raw, "payload": 0, "sent": self.sent_bytes}
            return InFlight(delta, done)
        if isinstance(self.compressor, QuantisedReduction):
            return InFlight(delta, self.compressor.launch(self.key, delta, self.group))
        work = self.compressor(None, GradBucket(self.key, delta, [delta], [], True))  # the hook averages

        def done() -> dict[str, int]:
            mean = work.wait()
            if mean.data_ptr() != delta.data_ptr():
                delta.copy_(mean)
            stats = self.compressor.stats.close_step()
            return {"raw": raw, "payload": stats["payload_bytes"], "sent": stats["sent_bytes"]}
        return InFlight(delta, done)

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's pseudo-gradient, ``g - x_i``, in fp32 on ``params``' device."""
        local = torch.cat([p.detach().reshape(-1).float() for p in params])
        return self.weights.to(local.device, copy=True).sub_(local)

    @torch.no_grad()
    def apply(self, delta: torch.Tensor, params: Sequence[torch.Tensor], keep: float = 0.0) -> None:
        """The outer optimizer's step on the global weights with the averaged ``delta``; ``params`` restart from
        them, or keep a share ``keep`` of their own (Streaming DiLoCo's mixing factor alpha: ``params <- alpha *
        params + (1 - alpha) * global``, torchft's ``fragment_update_alpha``)."""
        self.weights.grad = delta.to(self.weights.device)
        self.optimizer.step()
        self.weights.grad = None
        restart = [piece.view_as(p) for piece, p in zip(self.weights.to(params[0].device).split(self.sizes), params,
                                                        strict=True)]
        if keep:
            torch._foreach_lerp_(list(params), [r.to(p.dtype) for r, p in zip(restart, params, strict=True)],
                                 1.0 - keep)
        else:
            torch._foreach_copy_(list(params), restart)

    def reduce_over(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, participants: int,
                    participating: bool) -> RoundDelta:
        """Live recovery's reduction, waited for (:meth:`launch_over`)."""
        return self.launch_over(params, group, participants, participating).wait()

    @torch.no_grad()
    def launch_over(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, participants: int,
                    participating: bool) -> Launched:
        """Live recovery's reduction: the pseudo-gradient averaged over the ``participants`` members of a round's
        ``group`` (a process group outside torch.distributed's world; None: a round of one), nothing applied;
        launched, and its ``wait`` waits for it (Streaming DiLoCo's overlap runs inner steps between).

        A member healed in this round (``participating`` False) holds a peer's inner steps, not
        its own: it adds zeros, and its error-feedback residual (the peer's) is cleared. The
        residual as it was is kept in the result, for :meth:`restore` when the round aborts.
        Compressed, the payloads are all-gathered (:meth:`_gathered_mean`).
        """
        delta = self.pseudo_gradient(params) if participating else \
            torch.zeros(self.weights.numel(), device=params[0].device)
        saved = self.compressor.state_dict() if self.compressor is not None else None  # copies
        if saved is not None and not participating and self.compressor.feedback is not None:
            self.compressor.feedback.residuals = {}
        raw = delta.numel() * delta.element_size()
        size = group.size() if group is not None else 1
        if size == 1:
            return Launched(lambda: RoundDelta(delta, {"raw": raw, "payload": 0, "sent": 0}, saved), saved)
        if self.compressor is None:
            work = group.allreduce([delta])

            def done() -> RoundDelta:
                work.wait()
                delta.div_(participants)
                return RoundDelta(delta, {"raw": raw, "payload": 0, "sent": collective_cost(
                    "all_reduce", "ring", delta.numel(), 4, size).bytes_sent[group.rank()]}, saved)
            return Launched(done, saved)
        gathered = self._gathered_mean(delta, group, participants, participating)
        return Launched(lambda: RoundDelta(delta, gathered(), saved), saved)

    def _gathered_mean(self, delta: torch.Tensor, group: dist.ProcessGroup, participants: int,
                       participating: bool) -> Callable[[], dict[str, int]]:
        """``delta`` becomes the participants' mean through the codec: each member's encoding (with its error
        feedback; a member that sits out sends zeros and keeps no residual) all-gathered over ``group`` with the
        group's own methods (a round's group is outside torch.distributed's world), every one decoded and summed in
        fp32 in the members' order, so every member holds the same mean. (k - 1) payloads sent per member: twice a
        ring's share, once every H steps. Launched; the function returned waits, sums and gives the bytes."""
        codec, k = self.compressor.codec, group.size()
        payload = self.compressor.feedback.encode(self.key, delta, codec) if participating and \
            self.compressor.feedback is not None else codec.encode(delta)
        gathered = [[torch.empty_like(t) for _ in range(k)] for t in payload.tensors]
        works = [group.allgather([pieces], [t]) for pieces, t in zip(gathered, payload.tensors, strict=True)]

        def done() -> dict[str, int]:
            for work in works:
                work.wait()
            delta.zero_()
            for member in range(k):
                delta.add_(codec.decode(Encoded(tuple(p[member] for p in gathered), payload.numel)))
            delta.div_(participants)
            return {"raw": delta.numel() * delta.element_size(), "payload": payload.nbytes,
                    "sent": (k - 1) * payload.nbytes}
        return done

    def restore(self, reduced: RoundDelta) -> None:
        """A round that aborted: the error-feedback residual as it was before :meth:`reduce_over`."""
        self.restore_residual(reduced.residual)

    def restore_residual(self, residual: dict | None) -> None:
        """The error-feedback residual ``residual`` (a copy taken before a live round's reduction) put back."""
        if self.compressor is not None and residual is not None:
            self.compressor.load_state_dict(residual)

    def state_dict(self) -> dict:
        """The global weights and the outer optimizer: the same on every rank."""
        return {"weights": self.weights, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The global weights and the outer momentum; the error-feedback residual is this rank's own, loaded apart
        (:meth:`load_residual`)."""
        self.weights.copy_(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])

    def residual(self) -> dict | None:
        """This rank's error-feedback residual (it differs between ranks), or None uncompressed."""
        return self.compressor.state_dict() if self.compressor is not None else None

    def load_residual(self, state: dict | None) -> None:
        if self.compressor is not None and state is not None:
            self.compressor.load_state_dict(state)


@torch.no_grad()
def outer_step_naive(global_params: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                     optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None) -> None:
    """The oracle: per tensor, the pseudo-gradient all-reduced with ``torch.distributed``, the outer optimizer
    stepped over ``global_params`` (their own tensors), then copied into ``params``."""
    world = dist.get_world_size(group)
    for g, x in zip(global_params, params, strict=True):
        delta = g - x
        dist.all_reduce(delta, group=group)
        g.grad = delta / world
    optimizer.step()
    for g, x in zip(global_params, params, strict=True):
        g.grad = None
        x.copy_(g)
