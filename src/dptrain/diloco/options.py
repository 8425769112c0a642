"""DiLoCo's options as one small frozen policy, checked where they are written."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dptrain.diloco.fragments import PATTERNS

__all__ = ["DiLoCoOptions", "CODECS"]

CODECS = ("none", "bf16", "int8", "int4", "e3m0")  # what the pseudo-gradient's reduction may be compressed with


@dataclass(frozen=True)
class DiLoCoOptions:
    """How often the ranks meet and how the outer step moves the global weights.

    ``period`` (H): inner steps between two outer steps. ``outer_lr``, ``outer_momentum``,
    ``nesterov``: the outer optimizer, SGD (the paper's defaults: 0.7, 0.9, Nesterov).
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
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
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
        if not self.outer_lr > 0:
            raise ValueError(f"DiLoCo's outer_lr must be above 0, got {self.outer_lr!r}; the paper's is 0.7 (1 "
                             "with no momentum takes the average of the ranks' weights)")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCo's outer_momentum must be in [0, 1), got {self.outer_momentum!r}; the paper's "
                             "is 0.9")
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
                             f"got {self.overlap_steps!r}: one reduction is in flight at a time")
        if not 0 <= self.mixing < 1:
            raise ValueError(f"DiLoCo's mixing must be in [0, 1), got {self.mixing!r}; 0 takes the global weights "
                             "(torchft's default), the paper also uses 0.5")

    @classmethod
    def from_section(cls, section: Any, ddp: dict[str, Any] | None = None) -> DiLoCoOptions:
        """From a run config's ``[diloco]`` section (and the DDP engine's options for the warm-up)."""
        return cls(period=section.period, outer_lr=section.outer_lr, outer_momentum=section.outer_momentum,
                   nesterov=section.nesterov, compression=section.compression, error_feedback=section.error_feedback,
                   offload=section.offload, warmup_steps=section.warmup_steps, ddp=dict(ddp or {}),
                   fragments=section.fragments, fragment_pattern=section.fragment_pattern,
                   overlap_steps=section.overlap_steps, mixing=section.mixing)
