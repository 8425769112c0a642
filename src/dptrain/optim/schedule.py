"""Learning rate: the scaling rule for the global batch, then warmup and cosine decay.

Hyperparameters are usually published for one global batch size. When data parallelism
changes the global batch, the peak learning rate is adjusted by a scaling rule: linear
(Goyal et al. 2017, "Accurate, Large Minibatch SGD": lr x B/B0, with warmup), square
root (Krizhevsky 2014; Hoffer et al. 2017: lr x sqrt(B/B0), often better for Adam), or
none. The schedule is then a linear warmup to the peak followed by a cosine decay to
``min_ratio`` x peak at the last step (Loshchilov & Hutter 2017), as in nanoGPT.
"""

from __future__ import annotations

import math

__all__ = ["scaled_lr", "warmup_cosine", "schedule_warnings"]


def scaled_lr(lr: float, rule: str, global_batch_size: int, base_batch_size: int) -> float:
    ratio = global_batch_size / base_batch_size
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown LR scaling rule {rule!r}; use none, linear or sqrt")


def warmup_cosine(step: int, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    floor = peak * min_ratio
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def schedule_warnings(steps: int, warmup_steps: int) -> list[str]:
    """A warning when the learning-rate warm-up does not end before the run does (the schedule is
    :func:`~dptrain.optim.schedule.warmup_cosine`: the rate rises for ``warmup_steps`` steps, then decays)."""
    if warmup_steps < steps:
        return []
    reached = (f"reaches {steps}/{warmup_steps} = {steps / warmup_steps:.0%} of its peak at the last step"
               if warmup_steps > steps else "reaches its peak only at the last step")
    return [f"warning: train.warmup_steps {warmup_steps} is not below train.steps {steps}: the learning rate rises "
            f"for the whole run, {reached}, and never decays (train.min_lr_ratio has no effect); set "
            f"train.warmup_steps below {steps}, e.g. {max(1, steps // 10)} (a tenth of the run, as the default 30 "
            "of 300)"]
