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

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from dptrain.comm.topology import shard_bounds
from dptrain.compress.codecs import Codec, Encoded

__all__ = ["encode_shards", "decode_shards", "exchange_sum", "pack", "sent_bytes", "sum_decoded", "unpack"]


def encode_shards(codec: Codec, x: torch.Tensor, world_size: int) -> list[Encoded]:
    """``x`` (flat) cut into ``world_size`` shards, each encoded on its own."""
    return [codec.encode(x[a:b]) for a, b in shard_bounds(x.numel(), world_size)]


def decode_shards(codec: Codec, pieces: list[Encoded], out: torch.Tensor) -> torch.Tensor:
    """:func:`encode_shards`' pieces decoded back into ``out`` (flat fp32, the whole buffer's size)."""
    offset = 0
    for piece in pieces:
        codec.decode(piece, out=out[offset:offset + piece.numel])
        offset += piece.numel
    return out


def sent_bytes(pieces: list[Encoded], rank: int) -> int:
    """Bytes this rank sends in :func:`exchange_sum`: every encoded shard but its own."""
    return sum(p.nbytes for p in pieces) - pieces[rank].nbytes


def exchange_sum(codec: Codec, pieces: list[Encoded], rank: int, group: dist.ProcessGroup,
                 out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
                 clock: Callable[[str], AbstractContextManager] | None = None) -> torch.Tensor:
    """Send encoded shard j to rank j; return the fp32 sum of every rank's shard ``rank``, decoded.

    A payload's tensors (int8's values and scales) travel packed as bytes in one
    all-to-all, not one collective each. ``out`` receives the sum and ``scratch`` (both
    fp32, the shard's size) the pieces as they are decoded: given, nothing is allocated
    for them (a fresh buffer page-faults on first write, see dptrain.comm.wire.Workspace).
    ``clock("communicate")``, if given, times the all-to-all (:meth:`CompressionStats.clock`).
    """
    n = len(pieces)
    mine = pieces[rank]
    sizes = [p.nbytes for p in pieces]
    received = torch.empty(n * sizes[rank], dtype=torch.uint8, device=mine.tensors[0].device)
    packed = torch.cat([pack(p) for p in pieces])
    with clock("communicate") if clock is not None else nullcontext():
        dist.all_to_all_single(received, packed, [sizes[rank]] * n, sizes, group=group)
    size = sizes[rank]
    out, scratch = (t if t is not None else torch.empty(mine.numel, dtype=torch.float32, device=received.device)
                    for t in (out, scratch))
    return sum_decoded(codec, [unpack(received[j * size:(j + 1) * size], mine) for j in range(n)], out, scratch)


def pack(payload: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """The payload's tensors as one flat uint8 tensor (their bytes, one after another), in ``out`` if given."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in payload.tensors], out=out)


def sum_decoded(codec: Codec, payloads: list[Encoded], out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of the payloads' decodings, in ``out``; ``scratch`` (the same size) receives each after the first."""
    codec.decode(payloads[0], out=out)
    for payload in payloads[1:]:
        out += codec.decode(payload, out=scratch)
    return out


def unpack(data: torch.Tensor, like: Encoded) -> Encoded:
    """Bytes packed by :func:`pack` back into tensors shaped and typed as ``like``'s."""
    tensors, offset = [], 0
    for t in like.tensors:
        nbytes = t.numel() * t.element_size()
        piece = data[offset:offset + nbytes]
        if piece.storage_offset() % t.element_size():  # viewing bytes as wider numbers needs them aligned
            piece = piece.clone()
        tensors.append(piece.view(t.dtype).view(t.shape))
        offset += nbytes
    return Encoded(tuple(tensors), like.numel)
