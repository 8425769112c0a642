"""A run's ``[compression]`` section: which codec compresses the gradient collectives, and the remedies that keep a
compressed run converging (error feedback, momentum correction, warm-up; docs/compression.md).

Its own values are checked here; what the strategy can compress, and the remedies against the optimizer, are
checked before launch in ``dptrain.strategies.requirements``."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.config.errors import ConfigError
from dptrain.config.fields import opt

__all__ = ["CompressionConfig", "CODECS"]

CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")


@dataclass
class CompressionConfig:
    method: str = opt("none", "gradient compression: none, fp16, bf16, int8 (per-chunk absmax), topk or powersgd "
                      "with strategy ddp; fp16, bf16 or int8 with zero1-3 (docs/compression.md)", choices=CODECS)
    error_feedback: bool = opt(True, "add what compression dropped to the next step's gradient (with ZeRO: a "
                               "full-size fp32 residual per unit)")
    topk_fraction: float = opt(0.01, "method topk: the fraction of each bucket's elements sent, in (0, 1]")
    powersgd_rank: int = opt(4, "method powersgd: the rank of each gradient matrix's approximation")
    momentum_correction: bool = opt(False, "method topk or powersgd with train.optimizer sgd: each rank keeps its "
                                    "own velocity (momentum train.momentum) and compresses the accumulated "
                                    "velocity, and the optimizer runs without momentum (deep gradient compression; "
                                    "docs/compression.md)")
    momentum_masking: bool = opt(True, "with momentum_correction and method topk: clear the coordinates sent from "
                                 "the velocity too")
    local_clip: float = opt(0.0, "method topk or powersgd: each rank clips each bucket of its own gradient to this "
                            "L2 norm / sqrt(ranks) before compressing; 0 off")
    topk_warmup_steps: int = opt(0, "method topk: send 25% at first, 4x less per stage, down to topk_fraction over "
                                 "this many steps; 0 off")
    powersgd_uncompressed_steps: int = opt(0, "method powersgd: all-reduce this many first steps uncompressed in "
                                           "fp32")
    powersgd_warmup_rank: int = opt(0, "method powersgd: the rank for the first powersgd_warmup_steps steps (0: "
                                    "powersgd_rank throughout)")
    powersgd_warmup_steps: int = opt(0, "method powersgd: how many first steps use powersgd_warmup_rank")

    def check(self) -> None:
        """This section's own values."""
        if self.powersgd_rank < 1:
            raise ConfigError(f"compression.powersgd_rank must be at least 1, got {self.powersgd_rank}")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ConfigError(f"compression.topk_fraction must be in (0, 1], got {self.topk_fraction}")
        if self.momentum_correction and not self.error_feedback:
            raise ConfigError("compression.momentum_correction accumulates the velocity that was not sent, which is "
                              "error feedback: set compression.error_feedback = true")
