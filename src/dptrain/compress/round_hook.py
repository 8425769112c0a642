"""Compressed gradients under live recovery: each bucket encoded, all-gathered over the round, decoded and averaged.

Under live recovery (:mod:`dptrain.live`) a step's gradients are averaged over the round's
members by a comm hook on the round's process group. That group is made outside
torch.distributed's world, and ``torch.distributed``'s collectives refuse such a group
(../shared/NOTES.md), so the compressed exchange uses the group's own methods, as DiLoCo's
compressed meetings do (:meth:`dptrain.diloco.outer.OuterStep.reduce_over`):

1. each member encodes its bucket with the codec (fp16, bf16, int8 or top-k), plus its
   error-feedback residual (Seide et al., 2014; Karimireddy et al., 2019:
   :mod:`~dptrain.compress.feedback`);
2. the encodings are all-gathered over the round's group;
3. every member decodes the ``k`` encodings and sums them in fp32 in the members' order, then
   divides by ``k``. So every member holds the same mean, bitwise, and the replicas stay equal.

Each member sends ``k - 1`` payloads per bucket. That is about twice what int8's two-phase
exchange sends in a fixed world (``2 (k - 1) / k``), but the codec's ratio to fp32 is kept.

**The residuals** are each member's own, and two rules keep them right:
- **A round that aborts** restores every residual its step touched. They are copied before
  the encoding into buffers kept from step to step, so the retried step encodes as the first
  attempt did. The cost is one copy of the gradient per step.
- **A member healed from a peer** starts with no residual, as at the start of a run: the
  peer's residual is the peer's own error, not the joiner's.

PowerSGD's shared ``Q`` warm start, 1-bit Adam's compressed momentum and deep gradient
compression's remedies all keep state across steps that a round of changing members cannot
keep. They are refused before launch (:func:`dptrain.strategies.requirements.check_live`).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from dptrain.compress.base import CompressionStats
from dptrain.compress.codecs import Codec, Encoded
from dptrain.compress.feedback import ErrorFeedback
from dptrain.live.group import RoundGroup

__all__ = ["RoundCompression"]


class RoundCompression:
    """``hook(state, bucket)`` for the DDP engine under live recovery (see the module docstring); the live gate
    gives it the round's group (:meth:`attach`) and registers it. ``stats``, ``begin_step``, ``state_dict`` and
    ``load_state_dict``: the protocol a run's compression keeps (:class:`dptrain.compress.base.Compressor`)."""

    def __init__(self, codec: Codec, error_feedback: bool = True):
        self.codec = codec
        self.feedback = ErrorFeedback() if error_feedback else None
        self.stats = CompressionStats()
        self.group: RoundGroup | None = None
        self.step = 0
        self.bytes = 0  # fp32 bytes reduced this step (the live gate's count, as for the uncompressed hook)
        self.sent = 0   # bytes this member sent this step
        self._saved: dict[Hashable, torch.Tensor | None] = {}  # each residual before this step (None: it had none)
        self._kept: dict[Hashable, torch.Tensor] = {}          # the copies' buffers, kept from step to step

    def attach(self, group: RoundGroup) -> RoundCompression:
        self.group = group
        return self

    def begin_step(self, step: int) -> None:
        self.step = step

    def __call__(self, state, bucket) -> _Gathered:
        buffer = bucket.buffer()
        group, key = self.group, bucket.index()
        raw = buffer.numel() * buffer.element_size()
        self.bytes += raw
        self.stats.raw_bytes += raw
        self.stats.buckets += 1
        if group.pg is None or group.error is not None:  # alone, or the step already failed: the local gradient
            return _Gathered(group, [], [], 0, buffer, self.codec)
        flat = buffer.detach().reshape(-1)
        if self.feedback is not None:
            self._save(key)
            payload = self.feedback.encode(key, flat, self.codec)
        else:
            payload = self.codec.encode(flat.float())
        k = group.size
        self.stats.payload_bytes += payload.nbytes
        self.stats.sent_bytes += (k - 1) * payload.nbytes
        self.sent += (k - 1) * payload.nbytes
        gathered = [[torch.empty_like(t) for _ in range(k)] for t in payload.tensors]
        works = [group.all_gather(pieces, t) for pieces, t in zip(gathered, payload.tensors, strict=True)]
        return _Gathered(group, works, gathered, payload.numel, buffer, self.codec)

    def _save(self, key: Hashable) -> None:
        """This step's first look at ``key``'s residual: a copy of it, for a round that aborts."""
        if key in self._saved:
            return
        residual = self.feedback.residuals.get(key)
        if residual is None:
            self._saved[key] = None
            return
        kept = self._kept.get(key)
        if kept is None or kept.shape != residual.shape:
            kept = self._kept[key] = torch.empty_like(residual)
        self._saved[key] = kept.copy_(residual)

    def sent_bytes(self, k: int) -> int:
        """What this member sent this step (``k``: the round's size; the gathered payloads, counted as sent)."""
        return self.sent

    def settle(self, committed: bool) -> None:
        """The round's decision: on abort, every residual as it was before the step."""
        if not committed and self.feedback is not None:
            for key, saved in self._saved.items():
                if saved is None:
                    self.feedback.residuals.pop(key, None)
                else:
                    self.feedback.residuals[key].copy_(saved)
        self._saved.clear()
        self.bytes = self.sent = 0

    def reset(self) -> None:
        """Healed from a peer: no residual of its own yet, as at the start of a run."""
        if self.feedback is not None:
            self.feedback.residuals = {}
        self._saved.clear()

    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict() if self.feedback else None, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if self.feedback is not None and state.get("feedback") is not None:
            self.feedback.load_state_dict(state["feedback"])


class _Gathered:
    """A bucket's handle: ``wait()`` returns the mean of the members' decoded encodings (the local gradient after a
    failure, or alone)."""

    __slots__ = ("group", "works", "gathered", "numel", "buffer", "codec")

    def __init__(self, group: RoundGroup, works: list, gathered: list, numel: int, buffer: torch.Tensor,
                 codec: Codec):
        self.group, self.works, self.gathered, self.numel = group, works, gathered, numel
        self.buffer, self.codec = buffer, codec

    def wait(self) -> torch.Tensor:
        if not self.works:
            return self.buffer
        ok = all([self.group.wait(work) for work in self.works])  # every one waited for, even after a failure
        if ok:
            k = self.group.size
            mean = torch.zeros(self.numel, dtype=torch.float32, device=self.buffer.device)
            for member in range(k):  # in the members' order: the same sum on every member
                mean.add_(self.codec.decode(Encoded(tuple(p[member] for p in self.gathered), self.numel)))
            self.buffer.copy_(mean.div_(k).view_as(self.buffer))
        return self.buffer
