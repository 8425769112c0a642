"""Local SGD's options as one small frozen policy (as ZeRO's, FSDP2's): checked where they are written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LocalSGDOptions"]


@dataclass(frozen=True)
class LocalSGDOptions:
    """How often the replicas are averaged, after how long a synchronous warm-up.

    ``period`` (H): optimizer steps between two averages of the replicas; 1 is synchronous
    SGD (each step's models averaged: the same step as DDP's with plain SGD). ``warmup_steps``:
    the first steps are the DDP engine's, gradients all-reduced every step (post-local SGD:
    Lin et al. 2020 start local steps once the loss has left its first, sharpest phase).
    ``ddp``: the DDP engine's keyword arguments for the warm-up (``bucket_cap_mb``...).
    """

    period: int = 8
    warmup_steps: int = 0
    ddp: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"local SGD's period must be a whole number of steps >= 1, got {self.period!r}; "
                             "1 averages after every step (synchronous SGD), e.g. 8")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"local SGD's warmup_steps must be a whole number >= 0, got {self.warmup_steps!r}")

    @classmethod
    def from_section(cls, section: Any, ddp: dict[str, Any] | None = None) -> LocalSGDOptions:
        """From a run config's ``[localsgd]`` section (its ``period`` and ``warmup_steps``)."""
        return cls(period=section.period, warmup_steps=section.warmup_steps, ddp=dict(ddp or {}))
