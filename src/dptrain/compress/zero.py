"""ZeRO's gradient reduce-scatter, compressed: each shard encoded, exchanged, summed in fp32 by its owner.

ZeRO (stages 1-3) reduces each unit's full-size gradient with a reduce-scatter: rank r
keeps only the average of shard r. A codec fits that collective when a shard can be
encoded by itself and the owner can add the decoded pieces: fp16, bf16 and int8 can
(:mod:`dptrain.compress.sharded`: one all-to-all of the encoded shards, an fp32 sum at
the owner, (N-1)/N of the payload sent per rank, like a ring reduce-scatter). PowerSGD
cannot: it compresses whole matrices, which ZeRO's flat shards cut apart; and top-k
(an all-gather of every rank's pairs) is built for the DDP engine only.

With error feedback each rank keeps one fp32 residual per unit, the size of the unit's
full gradient (what it encoded, not only its shard): with ZeRO stage 2 or 3 that is a
full-size gradient per rank again, the memory those stages exist to save. It is off
by default here for that reason (``error_feedback=True`` turns it on).

    model = ZeRO(model, stage=2, compression=ShardedCompression(make_codec("int8")))
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from dptrain.comm.work import Work
from dptrain.compress.base import LAUNCH, RUN, Compressor
from dptrain.compress.codecs import Codec, Half, Int8
from dptrain.compress.sharded import decode_shards, encode_shards, exchange_sum, sent_bytes

__all__ = ["ShardedCompression", "ZERO_CODECS"]

ZERO_CODECS = ("fp16", "bf16", "int8")


class ShardedCompression(Compressor):
    """``reduce_scatter(key, output, input)``: the average of ``input``'s shard over ranks, sent compressed."""

    def __init__(self, codec: Codec, error_feedback: bool = False, process_group: dist.ProcessGroup | None = None):
        if not isinstance(codec, (Half, Int8)):
            raise ValueError(f"ZeRO's reduce-scatter can be compressed with {', '.join(ZERO_CODECS)}, not "
                             f"{getattr(codec, 'name', None) or type(codec).__name__}: PowerSGD needs whole matrices "
                             "and top-k an all-gather; use them with the DDP engine (strategy ddp)")
        super().__init__(codec, error_feedback, process_group)

    def reduce_scatter(self, key: Hashable, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Start it; ``wait()`` fills ``output`` (this rank's shard of the average, in ``output``'s dtype).

        ``input`` is read here, before this returns (it is encoded), and may then be reused.
        """
        flat = input.detach().reshape(-1)
        self.stats.raw_bytes += input.numel() * input.element_size()
        self.stats.buckets += 1
        with self.stats.clock("encode"):
            share = torch.div(flat, self.world_size,
                              out=self._scratch(LAUNCH, 0, flat.numel(), torch.float32, flat.device))
            corrected = self.feedback.correct(key, share) if self.feedback is not None else share
            pieces = encode_shards(self.codec, corrected, self.world_size)
            if self.feedback is not None:
                sent = self._scratch(LAUNCH, 1, flat.numel(), torch.float32, flat.device)
                self.feedback.keep(key, corrected, decode_shards(self.codec, pieces, sent))
        self.stats.payload_bytes += sum(p.nbytes for p in pieces)
        self.stats.sent_bytes += sent_bytes(pieces, self.rank)
        numel = pieces[self.rank].numel
        total = output if output.dtype == torch.float32 else self._scratch(key, 1, numel, torch.float32, flat.device)
        decoded = self._scratch(RUN, 0, numel, torch.float32, flat.device)

        def run() -> None:
            exchange_sum(self.codec, pieces, self.rank, self.channel, out=total, scratch=decoded,
                         clock=self.stats.clock)

        def finish() -> torch.Tensor:
            return output if total is output else output.copy_(total)

        return self._submit(run, finish)
