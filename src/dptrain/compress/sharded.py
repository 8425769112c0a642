"""A reduce-scatter of encoded shards: all-to-all, then an fp32 sum at each shard's owner.

A buffer of ``numel`` elements is cut into the group's N shards (``shard_bounds``, the
layout ZeRO shards by), and each shard is encoded on its own. Rank j receives every
rank's encoding of shard j in one all-to-all (a direct exchange: each rank sends the
N-1 shards it does not own, (N-1)/N of its payload, as a ring reduce-scatter would),
decodes the N pieces and adds them in fp32. Nothing is ever summed in the compressed
format, so int8 cannot overflow and fp16 loses nothing to the sum; and the result is
the owner's shard of the sum of the decoded payloads, whatever the codec.

The DDP hook's int8 path uses this as its first phase (then re-quantises and
all-gathers); ZeRO's compressed reduction (:mod:`dptrain.compress.zero`) is this alone.
Every codec here encodes a given number of elements into tensors of fixed sizes (fp16,
bf16: one tensor; int8: values and per-chunk scales), which is what lets each rank
know how much it receives before it does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dptrain.comm.topology import shard_bounds
from dptrain.compress.codecs import Codec, Encoded

__all__ = ["encode_shards", "exchange_sum", "sent_bytes"]


def encode_shards(codec: Codec, x: torch.Tensor, world_size: int) -> list[Encoded]:
    """``x`` (flat) cut into ``world_size`` shards, each encoded on its own."""
    return [codec.encode(x[a:b]) for a, b in shard_bounds(x.numel(), world_size)]


def sent_bytes(pieces: list[Encoded], rank: int) -> int:
    """Bytes this rank sends in :func:`exchange_sum`: every encoded shard but its own."""
    return sum(p.nbytes for p in pieces) - pieces[rank].nbytes


def exchange_sum(codec: Codec, pieces: list[Encoded], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Send encoded shard j to rank j; return the fp32 sum of every rank's shard ``rank``, decoded."""
    n = len(pieces)
    mine = pieces[rank]
    received = []
    for k in range(len(mine.tensors)):
        sizes = [p.tensors[k].numel() for p in pieces]
        out = mine.tensors[k].new_empty(n * sizes[rank])
        dist.all_to_all_single(out, torch.cat([p.tensors[k] for p in pieces]), [sizes[rank]] * n, sizes,
                               group=group)
        received.append(out.view(n, sizes[rank]))
    total = torch.zeros(mine.numel, dtype=torch.float32, device=mine.tensors[0].device)
    for j in range(n):
        total += codec.decode(Encoded(tuple(r[j] for r in received), mine.numel)).float()
    return total
