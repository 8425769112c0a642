"""When ZeRO's collectives ran, and how long computation waited for them.

ZeRO's communication is not one wait at the end of backward as the DDP engine's is:
stage 3 all-gathers every unit before its forward and again in backward, and each
unit's reduce-scatter is waited for when the next one needs room
(:class:`~dptrain.zero.unit.ReductionQueue`) or at the end of backward. So each
collective is timed as DDP times a bucket, from launch to completion (``completed_at``
of dptrain.comm's handles, which their backend's callback stamps; else the moment it
was waited for, an upper bound), and every wait of the training thread is recorded
too. The *exposed* communication is the union of the waits, each cut to the span of the
collective it waited for: the part of the communication that computation did not hide,
so it is never more than the busy time.

The cost when nobody reads it: a ``perf_counter`` call and a list append per launch, two
calls and an append per wait, next to collectives of tens of microseconds at least (the
measured ratios: docs/zero.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dptrain.comm.step_stats import StepCommStats, union_length

__all__ = ["ShardedStepComm", "Timed", "start_timing"]


@dataclass
class ShardedStepComm(StepCommStats):
    """One step's ZeRO communication on this rank: every collective's span, and the waits for them.

    ``bucket_spans`` holds ``[unit, launched, completed]`` per collective (all-gathers included)
    and ``collectives`` the name of each ("all-gather", "reduce-scatter", "all-reduce over
    replicas"); ``calls``/``bytes`` count the gradient reductions as for the DDP engine.
    """

    collectives: list[str] = field(default_factory=list)
    waits: list[tuple[list, float, float]] = field(default_factory=list)  # (span waited for, start, end)

    @property
    def exposed_comm_s(self) -> float:
        """Time the training thread waited for a collective still running (union of the waits)."""
        return union_length([(max(s, span[1]), min(e, span[2])) for span, s, e in self.waits
                              if span[2] is not None and min(e, span[2]) > max(s, span[1])])

    @property
    def overlap(self) -> float:
        """Fraction of the communication time that computation hid (forward and backward alike)."""
        busy = self.comm_busy_s
        return max(0.0, 1.0 - self.exposed_comm_s / busy) if busy > 0 else 0.0

    def span_name(self, i: int) -> str:
        return f"{self.collectives[i]} unit {self.bucket_spans[i][0]}"


class Timed:
    """A collective's handle that completes its span and records the wait when waited for."""

    __slots__ = ("work", "stats", "span")

    def __init__(self, work, stats: ShardedStepComm, span: list):
        self.work, self.stats, self.span = work, stats, span

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        result = self.work.wait()
        end = time.perf_counter()
        if self.span[2] is None:
            self.span[2] = getattr(self.work, "completed_at", None) or end
        self.stats.waits.append((self.span, start, end))
        return result


def start_timing(work, stats: StepCommStats | None, collective: str, unit: int, tensor: torch.Tensor,
                 launched: float):
    """``work`` wrapped in a :class:`Timed` whose span starts at ``launched``; ``work`` itself when there are no stats.

    ``launched`` is read before the collective is started: a small one can complete on the
    backend's thread before its launch returns, and a span stamped after the launch would
    then end before it begins (a negative busy time).
    """
    if not isinstance(stats, ShardedStepComm):
        return work
    span = [unit, launched, None]
    stats.bucket_spans.append(span)
    stats.bucket_bytes.append(tensor.numel() * tensor.element_size())
    stats.collectives.append(collective)
    return Timed(work, stats, span)
