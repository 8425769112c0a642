"""DiLoCo's options as one small frozen policy, checked where they are written."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dptrain.diloco.fragments import PATTERNS

__all__ = ["DiLoCoOptions", "CODECS", "outer_lr_for", "sync_schedule", "wire_bytes"]

CODECS = ("none", "bf16", "int8", "int4", "e3m0")  # what the pseudo-gradient's reduction may be compressed with


# The scaling-law paper's best outer learning rate by the number of replicas M at H = 30 (Charles et al. 2025,
# "Communication-Efficient Language Model Training Scales Reliably and Robustly: Scaling Laws for DiLoCo", Fig. 7:
# independent of the model's size from 335M parameters on, growing with M)
OUTER_LR_BY_REPLICAS = {1: 0.4, 2: 0.6, 4: 0.6, 8: 0.8}


def outer_lr_for(replicas: int) -> float:
    """The outer learning rate for ``replicas`` replicas from :data:`OUTER_LR_BY_REPLICAS`: its value at a listed M,
    linear in log2 M between two, 0.8 beyond 8."""
    known = sorted(OUTER_LR_BY_REPLICAS)
    if replicas >= known[-1]:
        return OUTER_LR_BY_REPLICAS[known[-1]]
    below = max(m for m in known if m <= max(replicas, 1))
    above = min(m for m in known if m >= replicas)
    if below == above:
        return OUTER_LR_BY_REPLICAS[below]
    share = (math.log2(replicas) - math.log2(below)) / (math.log2(above) - math.log2(below))
    return round(OUTER_LR_BY_REPLICAS[below] + share * (OUTER_LR_BY_REPLICAS[above] - OUTER_LR_BY_REPLICAS[below]), 4)


@dataclass(frozen=True)
class DiLoCoOptions:
    """How often the ranks meet and how the outer step moves the global weights.

    ``period`` (H): inner steps between two outer steps. ``outer_lr``, ``outer_momentum``,
    ``nesterov``: the outer optimizer, SGD with Nesterov momentum (the papers': 0.9; 0.7 here, by
    dptrain's ablations: docs/localsgd.md); ``outer_lr`` 0 (the default) takes it from the number
    of replicas (:func:`outer_lr_for`, the scaling-law paper's best at H = 30: 0.6 for 2).
    ``compression``: the pseudo-gradient's reduction in ``bf16``, ``int8``, or 4 bits (``int4``,
    ``e3m0``: :mod:`dptrain.compress.fourbit`), summed in fp32 (with ``error_feedback``: what a
    rank's encoding lost is added to its next pseudo-gradient).
    ``offload``: the global weights and the outer optimizer's momentum live on the CPU, not
    on the device that computes (they are read once every H steps). ``warmup_steps``: the
    first steps are the DDP engine's, gradients all-reduced every step, and the global
    weights start where they end (the paper starts DiLoCo from a model trained
    synchronously); ``ddp``: the DDP engine's keyword arguments for them.

    Streaming DiLoCo (Douillard et al. 2025): ``fragments`` (P) splits the trained parameters
    (:mod:`dptrain.diloco.fragments`, by ``fragment_pattern``, or ``fragment_of(name) -> index``
    where given); each fragment has its own outer step every H steps, one fragment every H / P
    steps, so a sync point sends 1/P of the model. ``overlap_steps`` (tau): a fragment's
    pseudo-gradient is taken tau steps before its turn and reduced while those steps run.
    ``mixing`` (alpha): when the outer step lands, the replica's fragment becomes ``alpha *
    replica + (1 - alpha) * global`` (0, the default, torchft's: the global weights).
    """

    period: int = 50
    outer_lr: float = 0.0
    outer_momentum: float = 0.7
    nesterov: bool = True
    compression: str = "none"
    error_feedback: bool = True
    offload: bool = True
    warmup_steps: int = 0
    ddp: dict[str, Any] = field(default_factory=dict)
    fragments: int = 1
    fragment_pattern: str = "strided"
    overlap_steps: int = 0
    mixing: float = 0.0
    fragment_of: Callable[[str], int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"DiLoCo's period must be a whole number of inner steps >= 1, got {self.period!r}; "
                             "the paper uses 500 from a pretrained model, e.g. 50 from scratch")
        if not self.outer_lr >= 0:
            raise ValueError(f"DiLoCo's outer_lr must be 0 (by the number of replicas) or above, got "
                             f"{self.outer_lr!r}; the paper's is 0.7 (1 with no momentum takes the average of the "
                             "ranks' weights)")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCo's outer_momentum must be in [0, 1), got {self.outer_momentum!r}; the default "
                             "is 0.7, the papers' 0.9")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"DiLoCo's warmup_steps must be a whole number >= 0, got {self.warmup_steps!r}")
        if self.compression not in CODECS:
            raise ValueError(f"DiLoCo's compression must be one of {', '.join(CODECS)}, got {self.compression!r}")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1 or \
                self.period % self.fragments:
            raise ValueError(f"DiLoCo's fragments must be a whole number >= 1 dividing period = {self.period}, got "
                             f"{self.fragments!r}: one fragment syncs every period / fragments steps")
        if self.fragment_pattern not in PATTERNS:
            raise ValueError(f"DiLoCo's fragment_pattern must be one of {', '.join(PATTERNS)}, got "
                             f"{self.fragment_pattern!r}")
        slot = self.period // self.fragments
        if isinstance(self.overlap_steps, bool) or not isinstance(self.overlap_steps, int) or \
                not 0 <= self.overlap_steps < slot:
            raise ValueError(f"DiLoCo's overlap_steps must be a whole number in [0, period / fragments = {slot}), "
                             f"got {self.overlap_steps!r}: one reduction is in flight at a time (0: none overlapped)")
        if not 0 <= self.mixing < 1:
            raise ValueError(f"DiLoCo's mixing must be in [0, 1), got {self.mixing!r}; 0 takes the global weights "
                             "(torchft's default), the paper also uses 0.5")

    def lr_for(self, replicas: int) -> float:
        """The outer learning rate for ``replicas`` replicas: ``outer_lr``, or where it is 0 :func:`outer_lr_for`."""
        return self.outer_lr or outer_lr_for(replicas)

    @classmethod
    def from_section(cls, section: Any, ddp: dict[str, Any] | None = None) -> DiLoCoOptions:
        """From a run config's ``[diloco]`` section (and the DDP engine's options for the warm-up)."""
        return cls(period=section.period, outer_lr=section.outer_lr, outer_momentum=section.outer_momentum,
                   nesterov=section.nesterov, compression=section.compression, error_feedback=section.error_feedback,
                   offload=section.offload, warmup_steps=section.warmup_steps, ddp=dict(ddp or {}),
                   fragments=section.fragments, fragment_pattern=section.fragment_pattern,
                   overlap_steps=section.overlap_steps, mixing=section.mixing)


def wire_bytes(compression: str, numel: int) -> int:
    """The bytes of ``numel`` fp32 pseudo-gradient values as ``compression`` encodes them (one payload: what a ring
    all-reduce of it moves 2 (M - 1) / M times, and the 4-bit reductions too, :mod:`dptrain.diloco.quantised`)."""
    from dptrain.compress import make_codec
    from dptrain.compress.fourbit import FOUR_BIT

    if compression == "none":
        return 4 * numel
    codec = FOUR_BIT[compression]() if compression in FOUR_BIT else make_codec(compression)
    return codec.wire_bytes(numel)


def sync_schedule(section: Any, model: Any) -> tuple[int, tuple[int, ...], int, Callable[[int], int]]:
    """What DiLoCo's sync points reduce, from a run config's ``[diloco]`` section and the model: the inner steps
    between two (H / P), each fragment's elements in the order they sync, the overlap, and the bytes of n values on
    the wire."""
    from dptrain.diloco.fragments import split_fragments

    params = [p for p in model.parameters() if p.requires_grad]
    fragments = split_fragments(model, params, section.fragments, section.fragment_pattern)
    sizes = tuple(sum(params[i].numel() for i in members) for members in fragments)
    return (section.period // section.fragments, sizes, section.overlap_steps,
            lambda n: wire_bytes(section.compression, n))
