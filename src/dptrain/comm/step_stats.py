"""What one step's gradient reduction communicated, on this rank, and when.

Filled by the engines (the DDP reducer bucket by bucket, ZeRO unit by unit) and read by
the trainer's metrics (:mod:`dptrain.runner.metrics`): bytes reduced, bytes sent, and for
the DDP engine the spans that give exposed communication and overlap. An optimizer that
communicates inside its own step (1-bit Adam) reports that part as an :class:`InStepComm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["InStepComm", "StepCommStats", "union_length"]


@dataclass
class StepCommStats:
    """What one synced backward communicated (this rank), and when.

    ZeRO fills the counts only (calls, bytes, sent_bytes): its spans are not recorded, so its
    exposed communication and overlap read 0.
    """

    calls: int = 0
    bytes: int = 0
    # bytes this rank sent for its reductions, by the cost model (comm.sent_bytes); with a comm hook
    # or compression the compressor counts its own (dptrain.compress), and a user's hook nothing here
    sent_bytes: int = 0
    bucket_bytes: list[int] = field(default_factory=list)
    launch_order: list[int] = field(default_factory=list)
    launched_during_backward: int = 0
    backward_start: float = 0.0   # time.perf_counter() when the backward reached the outputs
    backward_end: float = 0.0     # when the last gradient was computed (finalize began)
    comm_end: float = 0.0         # when every reduction had been waited for
    optimizer_s: float = 0.0      # of which optimizer_in_backward's steps of reduced buckets (computation)
    # [bucket, launched, completed] per reduction (re-reductions included), in perf_counter
    # seconds. Completion is exact with Reducer.record_spans (a callback on the work's
    # future), else the time the reduction was waited for (an upper bound).
    bucket_spans: list[list] = field(default_factory=list)

    @property
    def exposed_comm_s(self) -> float:
        """Communication time not hidden behind backward: the wait after backward ended (less the optimizer
        steps taken meanwhile by ``optimizer_in_backward``, which are computation)."""
        return self.comm_end - self.backward_end - self.optimizer_s

    @property
    def tail_comm_s(self) -> float:
        """The cost model's floor on exposed communication: the bytes of the last reduction launched (by the
        last gradient: nothing computes after it to hide it) and of any launched once backward had ended, at this
        step's measured rate (all bytes over the busy time). What was exposed beyond it could have been hidden."""
        busy, total = self.comm_busy_s, sum(self.bucket_bytes)
        if busy <= 0 or total <= 0 or not self.bucket_spans:
            return 0.0
        last = max(start for _, start, _ in self.bucket_spans)
        tail = sum(n for n, (_, start, _) in zip(self.bucket_bytes, self.bucket_spans, strict=True)
                   if start >= min(last, self.backward_end))
        return busy * tail / total

    @property
    def comm_busy_s(self) -> float:
        """Time during which at least one reduction was in flight."""
        return union_length([(s, e) for _, s, e in self.bucket_spans if e is not None])

    @property
    def overlap(self) -> float:
        """Fraction of the communication time that ran while backward was still computing."""
        busy = self.comm_busy_s
        hidden = union_length([(s, min(e, self.backward_end)) for _, s, e in self.bucket_spans
                                if e is not None and s < self.backward_end])
        return hidden / busy if busy > 0 else 0.0


@dataclass
class InStepComm:
    """What an optimizer communicated inside its own ``step()`` (this rank, its last step), which no engine sees.

    An optimizer that averages something itself, after backward (1-bit Adam's momentum, in 1 bit
    per element), exposes this as ``optimizer.step_comm`` (None for a step that communicated
    nothing there). Nothing computes while it runs, so all of it is exposed: the trainer's metrics
    add it to the engine's exposed and busy communication (:mod:`dptrain.runner.metrics`). Bytes
    are counted where the step's other bytes are (1-bit Adam: its compressor's statistics).
    """

    spans: list[tuple[float, float]] = field(default_factory=list)  # perf_counter (start, end): collectives with
    # their encoding and decoding

    @property
    def seconds(self) -> float:
        return union_length(self.spans)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
