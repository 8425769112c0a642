"""What top-k and PowerSGD need beyond the codec to converge like uncompressed training.

A lossy codec with error feedback sends, over T steps, everything but the last residual
(:mod:`~dptrain.compress.feedback`); how fast the model still learns depends on *when*
that mass arrives. :class:`Remedies` holds the schedules and corrections from the
literature that change it, for :class:`~dptrain.compress.hook.CompressionHook`:

- ``momentum`` (DGC momentum correction, Lin et al. 2018, :mod:`~dptrain.compress.dgc`):
  each rank keeps its own velocity and compresses the accumulated velocity instead of the
  gradient; the optimizer then runs without momentum (SGD, momentum 0). With top-k,
  ``masking`` also clears the sent coordinates from the velocity. With PowerSGD the
  velocity is what PowerSGD approximates, its error feedback the accumulation: error
  feedback before the momentum instead of after it;
- ``local_clip``: each rank clips each bucket of its own gradient to
  ``local_clip / sqrt(N)`` before compressing (DGC's local gradient clipping);
- ``topk_warmup_steps``: top-k starts at 25% and falls 4x per stage to its fraction over
  these steps (DGC's exponential sparsity warm-up, :func:`~dptrain.compress.dgc.warmup_fraction`);
- ``powersgd_uncompressed_steps``: the first steps are all-reduced uncompressed, in fp32
  (torch's ``start_powerSGD_iter``: early gradients change fast and a rank-r
  approximation warm-started from the last step's Q lags them);
- ``powersgd_warmup_rank`` for the first ``powersgd_warmup_steps`` steps: a higher rank
  while the loss falls fastest, then the configured rank.

The schedules read the step index (0-based, steps already taken) that the trainer
gives :meth:`~dptrain.compress.base.Compressor.begin_step`; every rank gives the same,
so the payload sizes of a collective agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.compress.dgc import warmup_fraction

__all__ = ["Remedies"]


@dataclass(frozen=True)
class Remedies:
    """Corrections and schedules for top-k and PowerSGD (module docstring); the defaults change nothing."""

    momentum: float | None = None
    masking: bool = True
    local_clip: float = 0.0
    topk_warmup_steps: int = 0
    powersgd_uncompressed_steps: int = 0
    powersgd_warmup_rank: int = 0
    powersgd_warmup_steps: int = 0

    def __post_init__(self):
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(f"momentum correction needs a momentum in [0, 1), got {self.momentum}")
        for name in ("local_clip", "topk_warmup_steps", "powersgd_uncompressed_steps", "powersgd_warmup_rank",
                     "powersgd_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")

    def check(self, codec_name: str) -> None:
        """Refuse options that the codec ``codec_name`` has no use for, naming the ones it has."""
        topk_only = {"momentum_masking = false": not self.masking, "topk_warmup_steps": self.topk_warmup_steps}
        powersgd_only = {"powersgd_uncompressed_steps": self.powersgd_uncompressed_steps,
                         "powersgd_warmup_rank": self.powersgd_warmup_rank,
                         "powersgd_warmup_steps": self.powersgd_warmup_steps}
        both = {"momentum_correction": self.momentum is not None, "local_clip": self.local_clip}
        allowed = {"topk": topk_only.keys() | both.keys(), "powersgd": powersgd_only.keys() | both.keys()}.get(
            codec_name, set())
        used = [k for k, v in {**topk_only, **powersgd_only, **both}.items() if v and k not in allowed]
        if used:
            raise ValueError(f"{' and '.join(used)} set, but compression {codec_name} has no use for it: momentum "
                             "correction and local clipping are for topk and powersgd, masking and the sparsity "
                             "warm-up for topk, the uncompressed start and the warm-up rank for powersgd")
        if bool(self.powersgd_warmup_rank) != bool(self.powersgd_warmup_steps):
            raise ValueError("powersgd_warmup_rank and powersgd_warmup_steps go together: got rank "
                             f"{self.powersgd_warmup_rank} for {self.powersgd_warmup_steps} steps")

    def topk_fraction(self, step: int, target: float) -> float:
        return warmup_fraction(step, target, self.topk_warmup_steps)

    def powersgd_rank(self, step: int, rank: int) -> int:
        return self.powersgd_warmup_rank if step < self.powersgd_warmup_steps else rank

    def uncompressed(self, step: int) -> bool:
        return step < self.powersgd_uncompressed_steps
