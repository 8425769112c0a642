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

``remedies`` (:class:`~dptrain.compress.remedies.Remedies`) adds, for top-k and PowerSGD,
deep gradient compression's momentum correction, local clipping and sparsity warm-up,
and PowerSGD's uncompressed start and higher starting rank; the schedules follow the
step index given to :meth:`begin_step`.

The collectives run on a process group of their own, on dptrain's progress thread for
it, in launch order: a bucket's compressed reduction overlaps the rest of backward
like an uncompressed one, and never interleaves with the engine's own collectives.

``stats`` counts, per step, the bytes each rank's payloads take beside the bytes the
uncompressed fp32 buckets would, and the bytes it sends on the wire (what the
collectives above move per rank in a ring or direct exchange).
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from dptrain.comm.compat import all_gather_single
from dptrain.comm.cost import collective_cost
from dptrain.comm.topology import shard_bounds
from dptrain.comm.work import Work
from dptrain.compress.base import LAUNCH, RUN, CompressionStats, Compressor
from dptrain.compress.codecs import Codec, Encoded, Half, Int8, TopK
from dptrain.compress.dgc import MomentumCorrection, Velocity, clip_local
from dptrain.compress.feedback import finite_or_zero
from dptrain.compress.powersgd import PowerSGD, orthonormalise, project
from dptrain.compress.remedies import Remedies
from dptrain.compress.sharded import (
    decode_shards,
    encode_shards,
    exchange_sum,
    pack,
    sent_bytes,
    sum_decoded,
    unpack,
)
from dptrain.ddp.comm_hooks import GradBucket

__all__ = ["CompressionHook", "CompressionStats"]


class CompressionHook(Compressor):
    """``hook(state, bucket)`` for the DDP engine: compress, reduce with the codec's collective, decode."""

    def __init__(self, codec: Codec | PowerSGD, error_feedback: bool = True,
                 process_group: dist.ProcessGroup | None = None, remedies: Remedies | None = None):
        if not isinstance(codec, (Half, Int8, TopK, PowerSGD)):
            raise TypeError("CompressionHook supports the fp16, bf16, int8 and topk codecs and PowerSGD, "
                            f"got {codec!r}")
        remedies = remedies if remedies is not None else Remedies()  # none of DGC's remedies
        remedies.check(codec.name)
        if remedies.momentum is not None and not error_feedback:
            raise ValueError("momentum correction accumulates what was not sent, which is error feedback: "
                             "turn error_feedback on with it")
        psgd = isinstance(codec, PowerSGD)
        super().__init__(codec, error_feedback and not psgd, process_group)
        if psgd:  # its residuals are part of the algorithm
            codec.error_feedback = error_feedback
        self.remedies = remedies
        self.rank_of_codec = codec.rank if psgd else None  # PowerSGD's configured rank; the warm-up's is higher
        self.fraction = codec.fraction if isinstance(codec, TopK) else None  # top-k's target fraction
        # DGC: top-k's accumulation replaces error feedback's residual; PowerSGD's residual is its accumulation
        self.velocity = Velocity(remedies.momentum) if psgd and remedies.momentum is not None else None
        if not psgd and remedies.momentum is not None:
            self.feedback = MomentumCorrection(remedies.momentum, remedies.masking)
        self.begin_step(0)

    def begin_step(self, step: int) -> None:
        """Set the step's top-k fraction or PowerSGD rank from the remedies' schedules."""
        super().begin_step(step)
        if self.fraction is not None:
            self.codec.fraction = self.remedies.topk_fraction(step, self.fraction)
        if self.rank_of_codec is not None:
            rank = self.remedies.powersgd_rank(step, self.rank_of_codec)
            if rank != self.codec.rank:  # the warm start's Q has the old rank's columns; residuals carry over
                self.codec.rank = rank
                self.codec.qs.clear()

    # the hook protocol
    def __call__(self, state, bucket: GradBucket) -> Work:
        if not self.stats.timed:
            return self._launch(bucket)
        inline = self.world_size == 1  # its run happens inside the launch: not encoding
        start, before = time.perf_counter(), sum(self.stats.seconds.values()) if inline else 0.0
        work = self._launch(bucket)
        ran = sum(self.stats.seconds.values()) - before if inline else 0.0
        self.stats.add("encode", time.perf_counter() - start - ran)
        return work

    def _launch(self, bucket: GradBucket) -> Work:
        """Encode the bucket (on the caller's thread) and submit its reduction."""
        x = bucket.buffer()
        key = bucket.index()
        self.stats.raw_bytes += x.numel() * x.element_size()
        self.stats.buckets += 1
        flat = x.detach().reshape(-1)  # results are written back into the bucket's buffer
        if isinstance(self.codec, Half) and self.feedback is None and self.world_size > 1:
            return self._half(key, flat)
        if isinstance(self.codec, (Int8, TopK, PowerSGD)):
            return self._scaled(key, flat, bucket)
        # fp16/bf16 with error feedback: the share is encoded (dividing first keeps fp16's sum in range)
        share = torch.div(flat, self.world_size, out=self._scratch(LAUNCH, 0, flat.numel(), torch.float32, flat.device))
        payload = self._encode(key, share)
        self.stats.payload_bytes += payload.nbytes
        if self.world_size == 1:
            return Work.completed(lambda: self._store(key, flat, lambda out: self.codec.decode(payload, out=out)))
        return self._half(key, flat, payload)

    def _scaled(self, key, flat: torch.Tensor, bucket: GradBucket) -> Work:
        """int8, top-k and PowerSGD: compress the rank's own gradient, and put the average's 1/N into the payload.

        The int8 values and top-k's indices of ``g`` and of ``g / N`` are the same (up to a
        rounding at a tie), and so is PowerSGD's orthonormal P; scaling int8's per-chunk
        scales, top-k's k values or PowerSGD's Q instead of the whole bucket saves a pass
        over it. Error feedback's residuals (and momentum correction's velocity) are kept
        in the gradient's units (:meth:`residual_units`), not the share's.
        """
        n = self.world_size
        psgd = isinstance(self.codec, PowerSGD)
        # PowerSGD reads it until the reduction ends: a bf16 bucket's fp32 copy is the bucket's own then
        grad = flat if flat.dtype == torch.float32 else \
            self._scratch(key if psgd else LAUNCH, 0, flat.numel(), torch.float32, flat.device).copy_(flat)
        if self.remedies.local_clip:  # the rank's own gradient, to local_clip / sqrt(N); rewritten by the result
            clip_local(grad, self.remedies.local_clip, n)
        if psgd:
            if self.velocity is not None:
                grad = self.velocity.fold(key, grad)
            if self.remedies.uncompressed(self.step):
                return self._uncompressed(key, grad, flat)
            return self._powersgd(key, grad, [g.shape for g in bucket.gradients()], flat)
        if isinstance(self.codec, Int8) and n > 2:
            return self._int8(key, grad, flat)
        payload = self.codec.rescale_(self._encode(key, grad), 1.0 / n)
        self.stats.payload_bytes += payload.nbytes
        if n == 1:
            return Work.completed(lambda: self._store(key, flat, lambda out: self.codec.decode(payload, out=out)))
        if isinstance(self.codec, Int8):
            return self._int8_gathered(key, payload, flat)
        return self._topk(key, payload, flat)

    def _store(self, key, flat: torch.Tensor, write) -> torch.Tensor:
        """``write(out)`` fills an fp32 buffer with the result: the bucket's own when it is fp32."""
        if flat.dtype == torch.float32:
            return write(flat)
        return flat.copy_(write(self._scratch(key, 1, flat.numel(), torch.float32, flat.device)))

    def _count_all_reduce(self, numel: int, element_size: int) -> None:
        """Add the bytes this rank sends in a ring all-reduce of ``numel`` elements (none alone)."""
        if self.world_size > 1:
            self.stats.sent_bytes += collective_cost("all_reduce", "ring", numel, element_size,
                                                     self.world_size).bytes_sent[self.rank]

    def _encode(self, key, share: torch.Tensor) -> Encoded:
        return self.feedback.encode(key, share, self.codec) if self.feedback else self.codec.encode(share)

    def _half(self, key, flat: torch.Tensor, payload: Encoded | None = None) -> Work:
        """All-reduce in 16 bits; the result is written back into the bucket's own buffer ``flat``.

        Without error feedback the payload is ``flat / N`` cast to 16 bits in one pass.
        """
        if payload is None:
            half = self._scratch(key, 0, flat.numel(), self.codec.dtype, flat.device)
            payload = Encoded((torch.div(flat, self.world_size, out=half),), flat.numel())
            self.stats.payload_bytes += payload.nbytes
        (t,) = payload.tensors
        self._count_all_reduce(t.numel(), t.element_size())

        def run() -> None:
            with self.stats.clock("communicate"):
                dist.all_reduce(t, group=self.channel)

        return self._submit(run, lambda: flat.copy_(t))

    def _uncompressed(self, key, grad: torch.Tensor, flat: torch.Tensor) -> Work:
        """An fp32 all-reduce of the shares ``grad / N`` (PowerSGD's uncompressed start), in the bucket's buffer
        when it is fp32.

        ``grad`` is not reduced in place: it may be the velocity, which the next step reads.
        """
        total = flat if flat.dtype == torch.float32 else self._scratch(key, 1, flat.numel(), torch.float32,
                                                                          flat.device)
        torch.div(grad, self.world_size, out=total)
        self.stats.payload_bytes += 4 * total.numel()
        self._count_all_reduce(total.numel(), 4)

        def run() -> None:
            if self.world_size > 1:
                with self.stats.clock("communicate"):
                    dist.all_reduce(total, group=self.channel)

        return self._submit(run, lambda: total if total is flat else flat.copy_(total))

    def _topk(self, key, payload: Encoded, flat: torch.Tensor) -> Work:
        index, values = payload.tensors
        n = self.world_size
        all_index = index.new_empty(n * index.numel())
        all_values = values.new_empty(n * values.numel())
        self.stats.sent_bytes += (n - 1) * payload.nbytes  # ring all-gather: every other rank's pairs pass once

        def run() -> None:
            with self.stats.clock("communicate"):
                all_gather_single(all_index, index, group=self.channel)
                all_gather_single(all_values, values, group=self.channel)

        def finish() -> torch.Tensor:
            gathered = Encoded((all_index, all_values), payload.numel)
            return self._store(key, flat, lambda out: self.codec.decode(gathered, out=out))

        return self._submit(run, finish)

    def _int8_gathered(self, key, payload: Encoded, flat: torch.Tensor) -> Work:
        """int8 on 2 ranks: one all-gather of the payloads, decoded and summed in fp32 (into the bucket's buffer).

        At N = 2 it sends what the two-phase exchange sends (N - 1 = 2 (N - 1) / N payloads), in one
        collective instead of two and with no re-quantisation of the sum; beyond 2 ranks it would
        send more, and :meth:`_int8` is used.
        """
        codec, n = self.codec, self.world_size
        row = payload.nbytes
        mine = pack(payload, out=self._scratch(key, 3, row, torch.uint8, flat.device))
        gathered = self._scratch(key, 2, n * row, torch.uint8, flat.device)
        out = flat if flat.dtype == torch.float32 else self._scratch(key, 1, flat.numel(), torch.float32, flat.device)
        self.stats.sent_bytes += (n - 1) * row

        def run() -> None:
            with self.stats.clock("communicate"):
                all_gather_single(gathered, mine, group=self.channel)
            sum_decoded(codec, [unpack(piece, payload) for piece in gathered.view(n, row)], out,
                        self._scratch(RUN, 1, flat.numel(), torch.float32, flat.device))

        return self._submit(run, lambda: out if out is flat else flat.copy_(out))

    def _int8(self, key, grad: torch.Tensor, flat: torch.Tensor) -> Work:
        """All-to-all of int8 shards and fp32 sums (:mod:`~dptrain.compress.sharded`), re-quantise, all-gather."""
        codec, n, r = self.codec, self.world_size, self.rank
        # feedback on the whole bucket, quantised shard by shard; the average's 1/N goes into the scales
        corrected = self.feedback.correct(key, grad) if self.feedback is not None else grad
        pieces = encode_shards(codec, corrected, n)
        if self.feedback is not None:
            sent = self._scratch(LAUNCH, 1, grad.numel(), torch.float32, grad.device)
            self.feedback.keep(key, corrected, decode_shards(codec, pieces, sent))
        for piece in pieces:
            codec.rescale_(piece, 1.0 / n)
        bounds = shard_bounds(grad.numel(), n)
        sizes = [b - a for a, b in bounds]
        chunks = [-(-s // codec.chunk) for s in sizes]
        # phase two gathers one row of bytes per rank: its values, padded to a multiple of 4, then its scales
        width = -(-max(sizes) // 4) * 4
        row = width + 4 * max(chunks)
        gathered = self._scratch(key, 2, n * row, torch.uint8, grad.device)
        self.stats.payload_bytes += sum(p.nbytes for p in pieces)
        self.stats.sent_bytes += sent_bytes(pieces, r) + (n - 1) * row

        def run() -> None:
            mine_sum = self._scratch(RUN, 0, sizes[r], torch.float32, grad.device)
            decoded = self._scratch(RUN, 1, sizes[r], torch.float32, grad.device)
            again = codec.encode(exchange_sum(codec, pieces, r, self.channel, out=mine_sum, scratch=decoded,
                                              clock=self.stats.clock))
            mine = self._scratch(RUN, 2, row, torch.uint8, grad.device)  # padding bytes are never decoded
            mine[:sizes[r]] = again.tensors[0].view(torch.uint8)
            mine[width:width + 4 * chunks[r]] = again.tensors[1].view(torch.uint8)
            with self.stats.clock("communicate"):
                all_gather_single(gathered, mine, group=self.channel)

        def write(out: torch.Tensor) -> torch.Tensor:
            rows = gathered.view(n, row)
            for j, (a, b) in enumerate(bounds):
                values, scales = rows[j, :sizes[j]].view(torch.int8), rows[j, width:width + 4 * chunks[j]]
                codec.decode(Encoded((values, scales.view(torch.float32)), sizes[j]), out=out[a:b])
            return out

        def finish() -> torch.Tensor:
            return self._store(key, flat, write)

        return self._submit(run, finish)

    def _powersgd(self, key, grad: torch.Tensor, shapes: list[torch.Size], flat: torch.Tensor) -> Work:
        """See :mod:`dptrain.compress.powersgd`: all-reduce P (with the uncompressed rest), then Q.

        ``grad`` is the rank's gradient (or velocity), not its share: P's direction does not
        depend on the scale, the rest is divided by N as it is packed and Q once it is summed.
        """
        psgd, r, n = self.codec, self.codec.rank, self.world_size
        pieces = list(grad.split([s.numel() for s in shapes]))
        matrices, rest = [], []
        for i, (piece, shape) in enumerate(zip(pieces, shapes, strict=True)):
            if psgd.compresses(shape):
                m = piece.view(shape[0], -1)
                residual = psgd.residuals.get((key, i)) if psgd.error_feedback else None
                # m is a view of the bucket (or the velocity), reused next step: with a residual the sum forms
                # in the residual's buffer; the first residual gets a buffer of its own
                if residual is not None:
                    m = residual.add_(m)
                elif psgd.error_feedback:
                    m = m.clone()
                matrices.append((i, m))
            else:
                rest.append(i)
                if len(shape) >= 2 and f"{tuple(shape)}" not in psgd.fallbacks:
                    psgd.fallbacks.append(f"{tuple(shape)}")
                    if self.rank == 0:
                        warnings.warn(f"PowerSGD rank {r} is not below the smaller side of a {tuple(shape)} gradient; "
                                      "it is sent uncompressed", stacklevel=2)
        qs = [psgd.qs[(key, i)] if (key, i) in psgd.qs else psgd.initial_q((key, i), m.shape[1]) for i, m in matrices]
        n_p = sum(m.shape[0] * r for _, m in matrices)
        n_q = sum(m.shape[1] * r for _, m in matrices)
        device = grad.device
        p_flat = torch.cat([project(m, q).reshape(-1) for (_, m), q in zip(matrices, qs, strict=True)] + [pieces[i] for i in rest],
                           out=self._scratch(key, 2, n_p + sum(pieces[i].numel() for i in rest), torch.float32, device))
        p_flat[n_p:].div_(n)  # the uncompressed rest: the rank's share of the average
        q_flat = self._scratch(key, 3, n_q, torch.float32, device)
        self.stats.payload_bytes += 4 * (p_flat.numel() + n_q)
        for numel in (p_flat.numel(), n_q):
            self._count_all_reduce(numel, 4)
        # the update is written into the bucket's buffer when it is fp32: each matrix's after every Q_w is formed
        out = flat if flat.dtype == torch.float32 else self._scratch(key, 1, flat.numel(), torch.float32, device)
        offsets = [0]
        for s in shapes:
            offsets.append(offsets[-1] + s.numel())

        def run() -> None:
            if self.world_size > 1:
                with self.stats.clock("communicate"):
                    dist.all_reduce(p_flat, group=self.channel)
            hats, at = [], 0
            for _, m in matrices:
                hats.append(orthonormalise(p_flat[at:at + m.shape[0] * r].view(m.shape[0], r)))
                at += m.shape[0] * r
            local_qs, at = [], 0
            for (_, m), p_hat in zip(matrices, hats, strict=True):
                local_qs.append(project(m.t(), p_hat))
                q_flat[at:at + m.shape[1] * r] = local_qs[-1].reshape(-1)
                at += m.shape[1] * r
            if self.world_size > 1:
                with self.stats.clock("communicate"):
                    dist.all_reduce(q_flat, group=self.channel)
            q_flat.div_(n)  # the sum of the ranks' Q, as the average's
            at = 0
            for (i, m), p_hat, q_local in zip(matrices, hats, local_qs, strict=True):
                q = q_flat[at:at + m.shape[1] * r].view(m.shape[1], r)
                at += m.shape[1] * r
                psgd.qs[(key, i)] = q.clone()  # warm start for the next step
                if psgd.error_feedback:
                    # m is this hook's own tensor: what the approximation missed is formed in it
                    psgd.residuals[(key, i)] = finite_or_zero(m.addmm_(p_hat, q_local.t(), alpha=-1))
                torch.mm(p_hat, q.t(), out=out[offsets[i]:offsets[i + 1]].view(m.shape))
            at = n_p
            for i in rest:
                out[offsets[i]:offsets[i + 1]] = p_flat[at:at + pieces[i].numel()]
                at += pieces[i].numel()

        def finish() -> torch.Tensor:
            return out if out is flat else flat.copy_(out)

        return self._submit(run, finish)

    # checkpoints
    def residual_units(self) -> str:
        """What the residuals and velocities are kept in: the rank's gradient (int8, top-k, PowerSGD) or its share."""
        return "share" if isinstance(self.codec, Half) else "gradient"

    def state_dict(self) -> dict:
        return {**super().state_dict(), "residual_units": self.residual_units(),
                "powersgd": self.codec.state_dict() if isinstance(self.codec, PowerSGD) else None,
                "velocity": self.velocity.state_dict() if self.velocity is not None else None}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("residual_units", "share")  # checkpoints without the key kept shares
        if saved != self.residual_units():
            state = _rescaled(state, self.world_size if saved == "share" else 1.0 / self.world_size)
        super().load_state_dict(state)
        self.begin_step(state.get("step", 0))  # the saved step's schedule: PowerSGD's rank its Qs have
        if isinstance(self.codec, PowerSGD) and state.get("powersgd") is not None:
            self.codec.load_state_dict(state["powersgd"])
        if self.velocity is not None and state.get("velocity") is not None:
            self.velocity.load_state_dict(state["velocity"])


def _rescaled(state: dict, factor: float) -> dict:
    """``state`` with its error-feedback and PowerSGD residuals times ``factor`` (shares <-> gradients)."""
    state = dict(state)
    if state.get("feedback") is not None:
        state["feedback"] = {"residuals": {k: v * factor for k, v in state["feedback"]["residuals"].items()}}
    if state.get("powersgd") is not None:
        state["powersgd"] = {**state["powersgd"],
                             "residuals": {k: v * factor for k, v in state["powersgd"]["residuals"].items()}}
    return state
