"""What every compressed reduction keeps: its own process group, error-feedback residuals and byte counts.

The DDP hook (:mod:`dptrain.compress.hook`) and ZeRO's compressed reduce-scatter
(:mod:`dptrain.compress.zero`) both run their collectives on a process group of their
own, on dptrain's progress thread for it, in launch order: a compressed reduction
overlaps the rest of backward like an uncompressed one, and never interleaves with the
engine's own collectives. Both count, per step, the bytes the uncompressed buffers
would take, the bytes the encoded payloads take and the bytes sent on the wire.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dptrain.comm.progress import progress_thread
from dptrain.comm.wire import Workspace
from dptrain.comm.work import Work
from dptrain.compress.codecs import Codec
from dptrain.compress.feedback import ErrorFeedback

__all__ = ["CompressionStats", "Compressor", "LAUNCH", "RUN"]


@dataclass
class CompressionStats:
    """Bytes of the current step, this rank: fp32 buffers, encoded payloads, sent on the wire.

    With ``timed`` set, also the seconds the step's reductions spent in three kinds of
    work: ``encode`` (on the caller's thread, inside backward: the share, error feedback,
    the encoding), ``communicate`` (inside the collectives, on the progress thread,
    overlapping backward) and ``decode`` (everything else: decoding, the sums between
    phases, int8's re-quantisation, PowerSGD's orthonormalisation and products, and the
    write into the bucket when it is waited for). Off by default: timing is a clock read
    per section.
    """

    raw_bytes: int = 0
    payload_bytes: int = 0
    sent_bytes: int = 0
    buckets: int = 0
    timed: bool = False
    seconds: dict = field(default_factory=lambda: dict.fromkeys(SPANS, 0.0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def clock(self, kind: str) -> contextlib.AbstractContextManager:
        """A context that adds its wall time to ``seconds[kind]`` when timing is on (a no-op otherwise)."""
        return _Span(self, kind) if self.timed else _UNTIMED

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:  # the caller's thread and the progress thread both add
            self.seconds[kind] += seconds

    def close_step(self) -> dict:
        record = dict(raw_bytes=self.raw_bytes, payload_bytes=self.payload_bytes, sent_bytes=self.sent_bytes,
                      buckets=self.buckets)
        if self.timed:
            record.update({f"{k}_s": v for k, v in self.seconds.items()})
            self.seconds = dict.fromkeys(SPANS, 0.0)
        self.raw_bytes = self.payload_bytes = self.sent_bytes = self.buckets = 0
        return record


SPANS = ("encode", "communicate", "decode")
_UNTIMED = contextlib.nullcontext()


class _Span:
    def __init__(self, stats: CompressionStats, kind: str):
        self.stats, self.kind = stats, kind

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.stats.add(self.kind, time.perf_counter() - self.start)


LAUNCH, RUN = "launch", "run"  # scratch shared by all buckets, see Compressor._scratch


class Compressor:
    """A codec, optional error feedback, and the process group its collectives run on."""

    def __init__(self, codec: Codec, error_feedback: bool, process_group: dist.ProcessGroup | None):
        self.codec = codec
        self.feedback = ErrorFeedback() if error_feedback else None
        group = process_group if process_group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        # a group of its own: the progress thread's collectives never meet the engine's
        self.channel = dist.new_group(ranks=ranks, use_local_synchronization=True) if self.world_size > 1 else group
        self.stats = CompressionStats()
        self._spaces: dict = {}  # per bucket or unit: buffers reused from step to step
        self.step = 0

    def begin_step(self, step: int) -> None:
        """Before a step's backward: its index (0-based, the steps already taken), which schedules read."""
        self.step = step

    def _scratch(self, key, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer kept from one step to the next (a fresh one page-faults on first write).

        ``key``: a bucket's (unit's) key for what must live until its reduction is waited
        for (buckets are reduced concurrently; one key's is done before it is launched
        again); :data:`LAUNCH` for what is used up while a reduction is launched (on the
        caller's thread) and :data:`RUN` for what is used up inside one ``run`` (runs go one
        at a time on the progress thread): those are shared by every bucket, so they do not
        add a full-size buffer per bucket, which with ZeRO would undo the sharding.
        """
        return self._spaces.setdefault(key, Workspace()).get(numel, dtype, device, slot)

    def _submit(self, run: Callable[[], None], finish: Callable[[], torch.Tensor]) -> Work:
        """Run ``run`` on the progress thread (inline at world size 1); ``finish`` runs in ``wait()``.

        Timed, what ``run`` spends outside its collectives (clocked as ``communicate``) and
        all of ``finish`` count as ``decode``.
        """
        if self.stats.timed:
            run, finish = self._timed_run(run), self._timed_finish(finish)
        if self.world_size == 1:
            run()
            return Work.completed(finish)
        return progress_thread(self.channel).submit(run, finish)

    def _timed_run(self, run: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            start, talked = time.perf_counter(), self.stats.seconds["communicate"]  # runs go one at a time
            run()
            self.stats.add("decode", time.perf_counter() - start - (self.stats.seconds["communicate"] - talked))
        return timed

    def _timed_finish(self, finish: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def timed() -> torch.Tensor:
            with self.stats.clock("decode"):
                return finish()
        return timed

    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict() if self.feedback else None, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if self.feedback is not None and state.get("feedback") is not None:
            self.feedback.load_state_dict(state["feedback"])
