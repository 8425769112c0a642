"""A communication hook for the DDP engine that sends each bucket compressed, with the right collective.

``CompressionHook(codec, error_feedback=True)`` plugs into
``DistributedDataParallel.register_comm_hook(None, hook)`` (dptrain's engine; the
protocol is :mod:`dptrain.ddp.comm_hooks`). For each bucket it encodes the rank's
share of the average, ``buffer / N`` (plus the bucket's error-feedback residual), and
reduces it the way the codec allows:

- ``fp16`` / ``bf16``: an all-reduce of the 16-bit tensor (summing is what the wire
  does anyway), decoded to fp32; dividing by N first keeps fp16's sum in range;
- ``int8``: two phases that never add int8 numbers. The bucket is split into N shards
  (``shard_bounds``), each quantised on its own; an all-to-all sends shard j to rank j;
  rank j decodes the N pieces it received and adds them in fp32, re-quantises its
  averaged shard and all-gathers it. 2(N-1)/N of the int8 payload per rank, like a ring
  all-reduce of it; the second quantisation's error is not fed back;
- ``topk``: an all-gather of every rank's (index, value) pairs, scatter-added in fp32.
  (N-1) k pairs per rank: sparse payloads cannot be summed on the way;
- :class:`~dptrain.compress.powersgd.PowerSGD`: two all-reduces, of P (with the
  uncompressed vectors) and of Q, orthonormalising P in between; its error feedback is
  part of the algorithm.

The collectives run on a process group of their own, on dptrain's progress thread for
it, in launch order: a bucket's compressed reduction overlaps the rest of backward
like an uncompressed one, and never interleaves with the engine's own collectives.

``stats`` counts, per step, the bytes each rank's payloads take beside the bytes the
uncompressed fp32 buckets would, and the bytes it sends on the wire (what the
collectives above move per rank in a ring or direct exchange).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dptrain.comm.cost import collective_cost
from dptrain.comm.progress import Work, progress_thread
from dptrain.comm.topology import shard_bounds
from dptrain.compress.codecs import Codec, Encoded, Half, Int8, TopK
from dptrain.compress.feedback import ErrorFeedback
from dptrain.compress.powersgd import PowerSGD, orthonormalise
from dptrain.ddp.comm_hooks import GradBucket

__all__ = ["CompressionHook", "CompressionStats"]


@dataclass
class CompressionStats:
    """Bytes of the current step, this rank: fp32 buckets, encoded payloads, sent on the wire."""

    raw_bytes: int = 0
    payload_bytes: int = 0
    sent_bytes: int = 0
    buckets: int = 0
    history: list[dict] = field(default_factory=list)

    def close_step(self) -> dict:
        record = dict(raw_bytes=self.raw_bytes, payload_bytes=self.payload_bytes, sent_bytes=self.sent_bytes,
                      buckets=self.buckets)
        self.history.append(record)
        self.raw_bytes = self.payload_bytes = self.sent_bytes = self.buckets = 0
        return record


class CompressionHook:
    """``hook(state, bucket)`` for the DDP engine: compress, reduce with the codec's collective, decode."""

    def __init__(self, codec: Codec | PowerSGD, error_feedback: bool = True,
                 process_group: dist.ProcessGroup | None = None):
        if not isinstance(codec, (Half, Int8, TopK, PowerSGD)):
            raise TypeError("CompressionHook supports the fp16, bf16, int8 and topk codecs and PowerSGD, "
                            f"got {codec!r}")
        self.codec = codec
        self.feedback = ErrorFeedback() if error_feedback and not isinstance(codec, PowerSGD) else None
        if isinstance(codec, PowerSGD):  # its residuals are part of the algorithm
            codec.error_feedback = error_feedback
        group = process_group if process_group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        # a group of its own: the progress thread's collectives never meet the engine's
        self.channel = dist.new_group(ranks=ranks, use_local_synchronization=True) if self.world_size > 1 else group
        self.stats = CompressionStats()

    # the hook protocol
    def __call__(self, state, bucket: GradBucket) -> Work:
        x = bucket.buffer()
        share = x.detach().reshape(-1).float() / self.world_size
        key = bucket.index()
        self.stats.raw_bytes += x.numel() * x.element_size()
        self.stats.buckets += 1
        if isinstance(self.codec, PowerSGD):
            return self._powersgd(key, share, [g.shape for g in bucket.gradients()], x.dtype)
        if self.world_size == 1:
            payload = self._encode(key, share)
            return Work.completed(lambda: self.codec.decode(payload).to(x.dtype))
        if isinstance(self.codec, Int8):
            return self._int8(key, share, x.dtype)
        payload = self._encode(key, share)
        self.stats.payload_bytes += payload.nbytes
        if isinstance(self.codec, Half):
            return self._half(payload, x.dtype)
        return self._topk(payload, x.dtype)

    def _encode(self, key, share: torch.Tensor) -> Encoded:
        return self.feedback.encode(key, share, self.codec) if self.feedback else self.codec.encode(share)

    def _submit(self, run, finish) -> Work:
        return progress_thread(self.channel).submit(run, finish)

    def _half(self, payload: Encoded, dtype: torch.dtype) -> Work:
        (t,) = payload.tensors
        self.stats.sent_bytes += collective_cost("all_reduce", "ring", t.numel(), t.element_size(),
                                                 self.world_size).bytes_sent[self.rank]
        return self._submit(lambda: dist.all_reduce(t, group=self.channel), lambda: t.to(dtype))

    def _topk(self, payload: Encoded, dtype: torch.dtype) -> Work:
        index, values = payload.tensors
        n = self.world_size
        all_index = index.new_empty(n * index.numel())
        all_values = values.new_empty(n * values.numel())
        self.stats.sent_bytes += (n - 1) * payload.nbytes  # ring all-gather: every other rank's pairs pass once

        def run() -> None:
            dist.all_gather_single(all_index, index, group=self.channel)
            dist.all_gather_single(all_values, values, group=self.channel)

        def finish() -> torch.Tensor:
            return self.codec.decode(Encoded((all_index, all_values), payload.numel)).to(dtype)

        return self._submit(run, finish)

    def _int8(self, key, share: torch.Tensor, dtype: torch.dtype) -> Work:
        codec, n, r = self.codec, self.world_size, self.rank
        # feedback on the whole bucket, quantised shard by shard
        corrected = self.feedback.correct(key, share) if self.feedback is not None else share
        bounds = shard_bounds(share.numel(), n)
        pieces = [codec.encode(corrected[a:b]) for a, b in bounds]
        if self.feedback is not None:
            self.feedback.keep(key, corrected, torch.cat([codec.decode(p) for p in pieces]))
        sizes = [b - a for a, b in bounds]
        chunks = [-(-s // codec.chunk) for s in sizes]
        q_in = torch.cat([p.tensors[0] for p in pieces])
        s_in = torch.cat([p.tensors[1] for p in pieces])
        q_out = torch.empty(n * sizes[r], dtype=torch.int8)
        s_out = torch.empty(n * chunks[r], dtype=torch.float32)
        width, cwidth = max(sizes), max(chunks)
        gathered_q = torch.empty(n * width, dtype=torch.int8)
        gathered_s = torch.empty(n * cwidth, dtype=torch.float32)
        payload = sum(p.nbytes for p in pieces)
        self.stats.payload_bytes += payload
        mine = sizes[r] + 4 * chunks[r]
        self.stats.sent_bytes += (payload - mine) + (n - 1) * (width + 4 * cwidth)

        def run() -> None:
            dist.all_to_all_single(q_out, q_in, [sizes[r]] * n, sizes, group=self.channel)
            dist.all_to_all_single(s_out, s_in, [chunks[r]] * n, chunks, group=self.channel)
            total = torch.zeros(sizes[r])
            for j in range(n):
                piece = Encoded((q_out[j * sizes[r]:(j + 1) * sizes[r]], s_out[j * chunks[r]:(j + 1) * chunks[r]]),
                                sizes[r])
                total += codec.decode(piece)
            again = codec.encode(total)
            q_mine = torch.zeros(width, dtype=torch.int8)
            s_mine = torch.zeros(cwidth, dtype=torch.float32)
            q_mine[:sizes[r]] = again.tensors[0]
            s_mine[:chunks[r]] = again.tensors[1]
            dist.all_gather_single(gathered_q, q_mine, group=self.channel)
            dist.all_gather_single(gathered_s, s_mine, group=self.channel)

        def finish() -> torch.Tensor:
            parts = [codec.decode(Encoded((gathered_q[j * width:j * width + sizes[j]],
                                           gathered_s[j * cwidth:j * cwidth + chunks[j]]), sizes[j]))
                     for j in range(n)]
            return torch.cat(parts).to(dtype)

        return self._submit(run, finish)

    def _powersgd(self, key, share: torch.Tensor, shapes: list[torch.Size], dtype: torch.dtype) -> Work:
        """See :mod:`dptrain.compress.powersgd`: all-reduce P (with the uncompressed rest), then Q."""
        psgd, r = self.codec, self.codec.rank
        pieces = list(share.split([s.numel() for s in shapes]))
        matrices, rest = [], []
        for i, (piece, shape) in enumerate(zip(pieces, shapes)):
            if psgd.compresses(shape):
                m = piece.view(shape[0], -1)
                residual = psgd.residuals.get((key, i)) if psgd.error_feedback else None
                matrices.append((i, m + residual if residual is not None else m.clone()))
            else:
                rest.append(i)
                if len(shape) >= 2 and f"{tuple(shape)}" not in psgd.fallbacks:
                    psgd.fallbacks.append(f"{tuple(shape)}")
                    if self.rank == 0:
                        warnings.warn(f"PowerSGD rank {r} is not below the smaller side of a {tuple(shape)} gradient; "
                                      "it is sent uncompressed", stacklevel=2)
        qs = [psgd.qs[(key, i)] if (key, i) in psgd.qs else psgd.initial_q((key, i), m.shape[1]) for i, m in matrices]
        p_flat = torch.cat([(m @ q).reshape(-1) for (_, m), q in zip(matrices, qs)] + [pieces[i] for i in rest])
        n_p = sum(m.shape[0] * r for _, m in matrices)
        n_q = sum(m.shape[1] * r for _, m in matrices)
        q_flat = torch.empty(n_q)
        self.stats.payload_bytes += 4 * (p_flat.numel() + n_q)
        for numel in (p_flat.numel(), n_q):
            self.stats.sent_bytes += collective_cost("all_reduce", "ring", numel, 4, self.world_size).bytes_sent[
                self.rank] if self.world_size > 1 else 0
        out = torch.empty(share.numel())
        offsets = [0]
        for s in shapes:
            offsets.append(offsets[-1] + s.numel())

        def run() -> None:
            if self.world_size > 1:
                dist.all_reduce(p_flat, group=self.channel)
            hats, at = [], 0
            for _, m in matrices:
                hats.append(orthonormalise(p_flat[at:at + m.shape[0] * r].view(m.shape[0], r)))
                at += m.shape[0] * r
            local_qs, at = [], 0
            for (_, m), p_hat in zip(matrices, hats):
                local_qs.append(m.t() @ p_hat)
                q_flat[at:at + m.shape[1] * r] = local_qs[-1].reshape(-1)
                at += m.shape[1] * r
            if self.world_size > 1:
                dist.all_reduce(q_flat, group=self.channel)
            at = 0
            for (i, m), p_hat, q_local in zip(matrices, hats, local_qs):
                q = q_flat[at:at + m.shape[1] * r].view(m.shape[1], r)
                at += m.shape[1] * r
                psgd.qs[(key, i)] = q.clone()  # warm start for the next step
                if psgd.error_feedback:
                    lost = m - p_hat @ q_local.t()
                    psgd.residuals[(key, i)] = lost if bool(torch.isfinite(lost).all()) else torch.zeros_like(lost)
                out[offsets[i]:offsets[i + 1]] = (p_hat @ q.t()).reshape(-1)
            at = n_p
            for i in rest:
                out[offsets[i]:offsets[i + 1]] = p_flat[at:at + pieces[i].numel()]
                at += pieces[i].numel()

        if self.world_size == 1:
            run()
            return Work.completed(lambda: out.to(dtype))
        return self._submit(run, lambda: out.to(dtype))

    # checkpoints
    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict() if self.feedback else None,
                "powersgd": self.codec.state_dict() if isinstance(self.codec, PowerSGD) else None}

    def load_state_dict(self, state: dict) -> None:
        if self.feedback is not None and state.get("feedback") is not None:
            self.feedback.load_state_dict(state["feedback"])
        if isinstance(self.codec, PowerSGD) and state.get("powersgd") is not None:
            self.codec.load_state_dict(state["powersgd"])
