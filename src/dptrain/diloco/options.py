"""DiLoCo's options as one small frozen policy, checked where they are written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DiLoCoOptions", "CODECS"]

CODECS = ("none", "bf16", "int8")  # what the pseudo-gradient's all-reduce may be compressed with


@dataclass(frozen=True)
class DiLoCoOptions:
    """How often the ranks meet and how the outer step moves the global weights.

    ``period`` (H): inner steps between two outer steps. ``outer_lr``, ``outer_momentum``,
    ``nesterov``: the outer optimizer, SGD (the paper's defaults: 0.7, 0.9, Nesterov).
    ``compression``: the pseudo-gradient's all-reduce in ``bf16`` or ``int8`` (with
    ``error_feedback``: what a rank's encoding lost is added to its next pseudo-gradient).
    ``offload``: the global weights and the outer optimizer's momentum live on the CPU, not
    on the device that computes (they are read once every H steps). ``warmup_steps``: the
    first steps are the DDP engine's, gradients all-reduced every step, and the global
    weights start where they end (the paper starts DiLoCo from a model trained
    synchronously); ``ddp``: the DDP engine's keyword arguments for them.
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

    @classmethod
    def from_section(cls, section: Any, ddp: dict[str, Any] | None = None) -> DiLoCoOptions:
        """From a run config's ``[diloco]`` section (and the DDP engine's options for the warm-up)."""
        return cls(period=section.period, outer_lr=section.outer_lr, outer_momentum=section.outer_momentum,
                   nesterov=section.nesterov, compression=section.compression, error_feedback=section.error_feedback,
                   offload=section.offload, warmup_steps=section.warmup_steps, ddp=dict(ddp or {}))
