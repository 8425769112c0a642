"""When 1-bit Adam may freeze its second moment: once v has stopped drifting, measured, not guessed.

1-bit Adam (Tang et al. 2021, arXiv 2102.02888, section 3.1) rests on Adam's variance v
becoming stable early in training, and freezes it after a fixed warm-up. How early depends
on the model and on the run: frozen at the 30-step LR warm-up, the default GPT ended 1.02x
AdamW's loss after 150 steps, 1.07x after 300 and 1.34x after 1,000 (docs/compression.md),
because v was still moving when it froze. 0/1 Adam (Lu et al. 2022, arXiv 2202.06009,
section 4, and DeepSpeed's ``zoadam.py``) does not decide from v's values either: it keeps
updating v at steps spaced exponentially further apart (the interval doubles every
``var_update_scaler`` = 16 updates) until a set ``var_freeze_step``, with a full-precision
gradient all-reduce at each of them.

This rule measures the drift instead. Every ``window`` steps it takes, per parameter
tensor p, the mass of Adam's bias-corrected second moment,

    n_p(t) = sum(v_p) / (1 - beta2^t),

and compares it with the mass ``window`` steps before: the drift is the numel-weighted
mean of |ln(n_p(t) / n_p(t - window))| over the tensors with mass at both (a parameter
without a gradient yet has none). v freezes at the first such step, from ``earliest`` on
(the LR warm-up: v from steps at a tiny learning rate says little), where the drift is at
most ``tolerance``: with the defaults, the preconditioner of every tensor, taken together,
moved its scale by no more than ~10% over the last 10 steps. Per-tensor masses follow the
coordinate-level change closely while v is settling (recorded on the 2x80 GPT: 0.10 against
0.10 for the relative L1 change of sqrt(v) at step 60) and cost one sum per tensor every
``window`` steps, with one number per tensor to keep: checkpointed exactly, unlike a copy
of v. Trade-off: a later freeze costs fp32 steps; the drift at the freeze is what the
frozen v will be wrong by at first, and it only grows from there.

The rule's arithmetic is here, without process groups, so it can be fed recorded
statistics (tests/test_onebit_freeze.py); :class:`~dptrain.optim.onebit_adam.OneBitAdam`
computes the masses from its v, which every rank holds bitwise the same (it is updated
from the same averaged gradients), and all-reduces the verdict anyway, so that no rank
can freeze alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dptrain.config import RunConfig

__all__ = ["FreezeRule", "v_mass", "onebit_freeze", "onebit_notes"]


@dataclass(frozen=True)
class FreezeRule:
    """Freeze v at the first multiple of ``window`` from ``earliest`` on where its drift is at most ``tolerance``.

    See the module docstring. ``earliest``: the first step v may freeze at (dptrain run: the LR
    warm-up, ``train.warmup_steps``); ``window``: steps between the masses compared (at least 2);
    ``tolerance``: the largest drift, a mean |ln| of the mass ratios (0.1: about 10%).
    """

    earliest: int = 0
    window: int = 10
    tolerance: float = 0.1

    def __post_init__(self):
        if self.earliest < 0 or self.window < 2 or not self.tolerance > 0:
            raise ValueError(f"1-bit Adam's freeze rule: earliest {self.earliest}, window {self.window}, tolerance "
                             f"{self.tolerance}: need earliest >= 0, window >= 2 and tolerance > 0")

    def records_at(self, t: int) -> bool:
        """Whether step ``t`` (1-based) takes the masses: every ``window`` steps."""
        return t % self.window == 0

    def checks_at(self, t: int) -> bool:
        """Whether step ``t`` is a decision: a recording step from ``earliest`` on, with the one before it taken."""
        return self.records_at(t) and t >= self.first_check

    @property
    def first_check(self) -> int:
        """The first step the rule can freeze at."""
        start = max(self.earliest, 2 * self.window)
        return math.ceil(start / self.window) * self.window

    def drift(self, masses: torch.Tensor, before: torch.Tensor, numels: torch.Tensor) -> float:
        """Numel-weighted mean |ln(masses / before)| over the tensors with a mass in both (float64, one per tensor)."""
        both = (masses > 0) & (before > 0)
        if not bool(both.any()):
            return math.inf
        ratios = (masses[both] / before[both]).log().abs()
        weights = numels[both].to(torch.float64)
        return float((ratios * weights).sum() / weights.sum())

    def settled(self, drift: float) -> bool:
        return drift <= self.tolerance


def v_mass(v: torch.Tensor | None, beta2: float, t: int) -> float:
    """sum(v) / (1 - beta2^t), summed in float64 (0 for a tensor with no v yet): one tensor's statistic at step t."""
    return 0.0 if v is None else float(v.sum(dtype=torch.float64)) / (1 - beta2 ** t)


def onebit_freeze(cfg: RunConfig) -> tuple[int | None, FreezeRule]:
    """1-bit Adam's ``freeze_step`` and ``freeze_rule``: ``train.onebit_freeze_step`` where set (> 0), else None, v
    freezing when the rule finds it settled; the rule never before the LR warm-up's end."""
    t = cfg.train
    return t.onebit_freeze_step or None, FreezeRule(earliest=t.warmup_steps)


def onebit_notes(cfg: RunConfig) -> list[str]:
    """What to know before a 1-bit Adam run starts: a freeze_step earlier than the rule can ever freeze (the
    LR warm-up), or a run too short for the rule to freeze at all (then it is AdamW throughout)."""
    t = cfg.train
    if t.optimizer != "onebit_adam":
        return []
    step, rule = onebit_freeze(cfg)
    if step is not None and step < rule.first_check:
        return [f"warning: train.onebit_freeze_step {step} freezes 1-bit Adam's second moment before step "
                f"{rule.first_check}, the first the rule can freeze at (after the {t.warmup_steps}-step LR warm-up); "
                "frozen that early, v is stale for the rest of the run (docs/compression.md: up to 1.5x AdamW's "
                "loss at 1,000 steps). Leave it 0 to freeze when v settles"]
    if step is None and t.steps <= rule.first_check:
        return [f"note: 1-bit Adam freezes v once it settles, at step {rule.first_check} at the earliest; this run "
                f"has {t.steps} steps, so it runs uncompressed AdamW throughout"]
    return []
