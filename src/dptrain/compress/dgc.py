"""Deep Gradient Compression's remedies for top-k sparsification (Lin et al., ICLR 2018).

Plain error feedback (:mod:`dptrain.compress.feedback`) keeps what top-k dropped and adds it
to the next gradient. With momentum SGD that residual misses the momentum the dropped
coordinates would have gathered, and a coordinate may wait dozens of steps before it is
sent. DGC fixes this on the worker:

- **momentum correction** (DGC eq. 5-6): the worker keeps its own velocity
  ``u_t = m u_{t-1} + g_t`` and accumulates ``v_t = v_{t-1} + u_t``; it sends top-k of
  ``v_t`` and keeps the rest. The sum of what is sent equals the sum of the velocities,
  so the optimizer applies the average *without* momentum of its own (SGD, momentum 0);
- **momentum factor masking** (DGC sec. 3.2): the coordinates just sent are cleared in
  ``u`` as well as in ``v``, so stale momentum does not push them again (without
  masking, ``v`` keeps ``v - sent`` and ``u`` is kept whole);
- **local gradient clipping** (DGC sec. 3.2): before accumulating, each worker clips its
  own gradient to ``max_norm / sqrt(N)`` (N workers: the sum of N independent gradients
  has about sqrt(N) times the norm of one): :func:`clip_local`;
- **sparsity warm-up** (DGC sec. 3.3): the fraction sent starts at 25% and falls
  exponentially, a factor 4 per stage, to the target over the warm-up steps.

:class:`MomentumCorrection` has the interface of :class:`~dptrain.compress.feedback.ErrorFeedback`
(``encode(key, x, codec)``, state dicts), so the compression hook uses either. PowerSGD
takes the velocity alone (:class:`Velocity`): its own error feedback is the accumulation,
so the matrix it approximates is ``v_{t-1} + u_t`` (no masking: a low-rank update has no
"sent coordinates"). ``dptrain run`` turns these on with ``[compression] momentum_correction``,
``momentum_masking``, ``local_clip`` and ``topk_warmup_steps`` (docs/compression.md).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from dptrain.compress.codecs import Codec, Encoded, TopK
from dptrain.compress.feedback import ErrorFeedback, finite_or_zero, state_key

__all__ = ["MomentumCorrection", "Velocity", "clip_local", "warmup_fraction"]


class Velocity:
    """Per-key local momentum ``u_t = m u_{t-1} + g_t`` (DGC eq. 5), a key per bucket."""

    def __init__(self, momentum: float):
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum correction needs a momentum in [0, 1), got {momentum}")
        self.momentum = momentum
        self.velocity: dict[Hashable, torch.Tensor] = {}

    def fold(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """``u`` after adding the gradient ``x``: the key's own buffer (the first is a copy of ``x``).

        A velocity that turned non-finite (a skipped NaN step) starts again from zero.
        """
        g = x.reshape(-1).float()
        u = self.velocity.get(key)
        u = g.clone() if u is None or u.numel() != g.numel() else finite_or_zero(u).mul_(self.momentum).add_(g)
        self.velocity[key] = u
        return u

    def state_dict(self) -> dict:
        return {"velocity": {str(k): t.clone() for k, t in self.velocity.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = {state_key(k): t.clone() for k, t in state["velocity"].items()}


class MomentumCorrection:
    """Per-key velocity ``u`` and accumulation ``v`` of DGC's momentum correction (a key per bucket).

    ``v`` is error feedback's residual with the velocity fed in instead of the gradient, so
    it is kept by an :class:`~dptrain.compress.feedback.ErrorFeedback`; masking clears the
    sent coordinates instead of subtracting them.
    """

    def __init__(self, momentum: float, masking: bool = True):
        self.masking = masking
        self.velocities = Velocity(momentum)
        self.accumulation = ErrorFeedback()

    def encode(self, key: Hashable, x: torch.Tensor, codec: Codec) -> Encoded:
        """``codec.encode(v)`` after folding the gradient ``x`` into ``u`` and ``v``; what was sent leaves ``v``
        (and, with masking, ``u``)."""
        u = self.velocities.fold(key, x)
        v = self.accumulation.correct(key, u)  # v + u
        payload = codec.encode(v)
        if self.masking:  # the coordinates sent: top-k's indices, else wherever something was sent
            mask = payload.tensors[0].long() if isinstance(codec, TopK) else codec.decode(payload) != 0
            v[mask] = 0.0
            u[mask] = 0.0
            self.accumulation.residuals[key] = finite_or_zero(v)
        else:
            self.accumulation.keep(key, v, codec.decode(payload))
        return payload

    @property
    def velocity(self) -> dict[Hashable, torch.Tensor]:
        return self.velocities.velocity

    @property
    def accumulated(self) -> dict[Hashable, torch.Tensor]:
        return self.accumulation.residuals

    def state_dict(self) -> dict:
        return {**self.velocities.state_dict(), "accumulation": self.accumulation.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.velocities.load_state_dict(state)
        self.accumulation.load_state_dict(state["accumulation"])


def clip_local(g: torch.Tensor, max_norm: float, world_size: int) -> torch.Tensor:
    """``g`` scaled down, in place, to norm ``max_norm / sqrt(world_size)`` if it is longer (DGC's local clipping)."""
    limit = max_norm / math.sqrt(world_size)
    norm = float(torch.linalg.vector_norm(g))
    return g.mul_(limit / norm) if norm > limit else g


def warmup_fraction(step: int, target: float, warmup_steps: int, start: float = 0.25) -> float:
    """The fraction top-k sends at ``step`` (0-based): ``start``, divided by 4 per stage, never below ``target``.

    The warm-up's ``warmup_steps`` are split into equal stages, as many as the factor-4
    falls from ``start`` to ``target`` take (DGC: 75%, 93.75%, 98.4375%, 99.6% sparsity over
    the first four epochs); from ``warmup_steps`` on it is ``target``.
    """
    if not 0 < target <= 1 or start < target:
        raise ValueError(f"sparsity warm-up needs 0 < target <= start <= 1, got target {target}, start {start}")
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    stages = max(1, math.ceil(math.log(start / target, 4)))
    stage = step * stages // warmup_steps
    return max(target, start / 4 ** stage)
