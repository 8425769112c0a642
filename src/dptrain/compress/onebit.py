"""A 1-bit compressed all-reduce with error feedback on both sides: 1-bit Adam's two-stage scheme.

Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed" (arXiv 2102.02888), section 3.3 and Algorithm 1; DeepSpeed's
``runtime/comm/nccl.py`` (``compressed_allreduce``) is the reference implementation. To
average a flat tensor over N ranks, rank i holding x_i, cut into the N chunks of
``shard_bounds`` (chunk j belongs to rank j, its "server"):

1. **worker**: z = x_i + e_i, e_i the worker error (what earlier rounds did not send);
   each chunk z_j becomes its signs, 1 bit per element (0 counts as +, as in DeepSpeed),
   and one fp32 scale s = ||z_j||_2 / sqrt(n_j), so that s sign(z_j) keeps z_j's norm;
   e_i = z - s sign(z);
2. **all-to-all**: chunk j goes to rank j (``all_to_all_single`` of packed bytes, uneven
   splits: gloo and NCCL both take it);
3. **server** j: y = (sum_i s_ij sign(z_ij)) / N + e^s_j, e^s_j the server error of chunk j
   (each rank keeps its own chunk's); y is compressed the same way, e^s_j = y - s sign(y);
4. **all-gather** of the servers' compressed chunks (padded to the largest; sent as an
   all-to-all of copies, which on gloo allocates nothing, see ``_gather``): every rank
   decodes the same average.

Each phase moves about n/8 bytes per rank plus 4 per chunk: 1/32 of an fp32 ring
all-reduce. Two things differ from DeepSpeed, both said here: the worker keeps one scale
per chunk (DeepSpeed one per tensor, all-gathered: the same 4 bytes per destination, and a
closer fit), and chunks are ``shard_bounds``' (DeepSpeed pads the tensor to a multiple of
8N, so padding elements enter its scales and errors; here each chunk's bits are padded to
whole bytes and nothing else is).

:func:`naive_onebit_all_reduce` is the oracle and the baseline: the same arithmetic with
fp32 tensors (``where(z >= 0, s, -s)``), no packing, all-gathers of whole tensors. The
tests require the two to agree bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from dptrain.comm.progress import progress_thread
from dptrain.comm.topology import shard_bounds
from dptrain.comm.wire import Workspace
from dptrain.compress.base import RUN, Compressor
from dptrain.compress.codecs import Codec, Encoded
from dptrain.compress.sharded import sum_decoded, unpack

__all__ = ["OneBit", "OneBitAllReduce", "naive_onebit_all_reduce", "pack_signs", "unpack_signs", "sign_scale"]

# [Note: bit packing with one multiplication per 8 elements]
# Eight 0/1 bytes read as one little-endian int64 x (byte k = element k), times _PACK, put
# element k at bit 56 + k: the product's terms land on distinct bits (no carries), and those
# past bit 63 wrap away. The reverse: a byte times _SPREAD copies it into all 8 bytes, and
# _MASK keeps bit k of byte k. int64 products wrap modulo 2^64 on CPU and CUDA alike.
# Broadcasting bitwise ops or torch.where over the elements is 10-50x slower on CPU.
_PACK = 0x0102040810204080
_SPREAD = 0x0101010101010101
_MASK = 0x8040201008040201 - 2**64  # as a signed int64

# [Note: no temporaries in the 1-bit all-reduce]
# Issue 46: under 1-bit Adam each rank's resident set grew by about 0.5-0.9 MiB per step, all
# of it free heap that later allocations could not reuse (glibc's mallinfo after 300 calls of
# the all-reduce alone: 255-281 MiB free, up from 1.5, while 137 MiB in use stayed flat;
# malloc_info: ~300 free chunks of 0.56-0.92 MB). torch's flight recorder keeps an entry for each
# of the last 2,000 collectives, allocated on the thread that calls the collective; small blocks
# that live long, made between large short-lived ones, keep the freed blocks around them from
# merging. Two things put such entries among large temporaries, and both are gone:
# - the all-reduce allocated blocks of n / N bytes at every call (the sign mask, the packing's
#   int64 words, the payloads; 0.9 MB for the default GPT's 1.84M elements on 2 ranks), and
#   gloo's all_gather_into_tensor gathers into a temporary of its own. Now every such buffer is
#   kept from call to call (the codec's Workspace, the compressor's scratch: payloads are encoded
#   straight into the send buffers) and phase 2 is an all-to-all into a kept buffer;
# - its collectives (and 1-bit Adam's flags) ran on the training thread, among the activations
#   and gradients that backward allocates and frees every step. Now they run on the channel's
#   progress thread, whose heap holds nothing else (all_reduce_ waits for it).
# TORCH_FR_BUFFER_SIZE=0, glibc's per-thread cache off (GLIBC_TUNABLES=
# glibc.malloc.tcache_count=0) or the blocks served by mmap (MALLOC_MMAP_THRESHOLD_=524288;
# dptrain.allocator keeps everything under 32 MiB on the heap) each made it flat too; at world
# size 1 there are no collectives to record. Soaked in tests/test_compress_onebit.py (the
# all-reduce) and tests/test_onebit_adam.py (training).


def pack_signs(positive: torch.Tensor, out: torch.Tensor | None = None,
               words: torch.Tensor | None = None) -> torch.Tensor:
    """A bool tensor (flat, n) as ceil(n / 8) bytes, element k of each group of 8 in bit k.

    ``out`` (uint8, ceil(n / 8)) receives the bytes and ``words`` (int64, n // 8) holds the
    products on the way; given, nothing of the tensor's size is allocated
    ([Note: no temporaries in the 1-bit all-reduce]).
    """
    n = positive.numel()
    whole = n - n % 8
    bits = positive.contiguous().view(torch.uint8)
    packed = torch.empty(math.ceil(n / 8), dtype=torch.uint8, device=positive.device) if out is None else out
    if whole:
        groups = bits[:whole].clone() if bits.storage_offset() % 8 else bits[:whole]
        words = torch.empty(whole // 8, dtype=torch.int64, device=positive.device) if words is None else words
        torch.mul(groups.view(torch.int64), _PACK, out=words)
        packed[:whole // 8].copy_(words.bitwise_right_shift_(56).bitwise_and_(0xFF))
    if n % 8:
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64], dtype=torch.int64, device=positive.device)[:n % 8]
        packed[-1] = bits[whole:].to(torch.int64).mul_(weights).sum()
    return packed


def _spread(packed: torch.Tensor, n: int, words: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`pack_signs`' bytes back into ``n`` bytes, element k of a group 0 or 2^k (not 0 where it was set).

    ``words`` (int64, as many as ``packed``): where to spread them (else a new tensor); the result is a view of it.
    """
    words = packed.to(torch.int64) if words is None else words.copy_(packed)
    return words.mul_(_SPREAD).bitwise_and_(_MASK).view(torch.uint8)[:n]


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack_signs`' bytes back into its ``n`` bools."""
    return _spread(packed, n).ne(0)


def sign_scale(z: torch.Tensor) -> torch.Tensor:
    """The scale of 1-bit compression: ||z||_2 / sqrt(n) (0 for an empty chunk), a 0-dim fp32 tensor."""
    return torch.linalg.vector_norm(z) / math.sqrt(max(z.numel(), 1))


def _signed(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = +scale where ``bits`` is not 0, -scale where it is (exactly: 2s * 1 - s and 2s * 0 - s)."""
    return out.copy_(bits).clamp_(max=1.0).mul_(2.0 * scale).sub_(scale)


class OneBit(Codec):
    """Signs, 1 bit per element (0 counts as +), and one scale ||x||_2 / sqrt(n): n / 8 + 4 bytes.

    Its scratch (the sign mask, the packing's int64 words, the decoded signs) is kept from
    call to call: [Note: no temporaries in the 1-bit all-reduce].
    """

    name = "onebit"

    def __init__(self):
        self._work = Workspace()  # one buffer per dtype: bool mask, int64 words, fp32 signs

    def encode(self, x: torch.Tensor) -> Encoded:
        return self.encode_keeping_error_(x.detach().reshape(-1).float().clone())

    def encode_keeping_error_(self, x: torch.Tensor, out: torch.Tensor | None = None) -> Encoded:
        """Compress ``x`` (flat fp32) and leave ``x - s sign(x)`` in it: error feedback's step.

        ``out`` (uint8, :meth:`wire_bytes`): where the payload goes, packed as it travels (the
        signs' bytes, then the scale's 4); the returned payload's signs are a view of it.
        """
        n = x.numel()
        scale = sign_scale(x)
        positive = torch.ge(x, 0, out=self._work.get(n, torch.bool, x.device))
        x.sub_(_signed(positive, scale, self._work.get(n, torch.float32, x.device)))
        signs = math.ceil(n / 8)
        out = torch.empty(signs + 4, dtype=torch.uint8, device=x.device) if out is None else out
        pack_signs(positive, out=out[:signs], words=self._work.get(n // 8, torch.int64, x.device))
        out[signs:].copy_(scale.reshape(1).view(torch.uint8))
        return Encoded((out[:signs], scale.reshape(1)), n)

    def decode(self, payload: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = payload.tensors
        out = torch.empty(payload.numel, dtype=torch.float32, device=packed.device) if out is None else out
        words = self._work.get(packed.numel(), torch.int64, packed.device)
        return _signed(_spread(packed, payload.numel, words), scale.reshape(()), out)

    def wire_bytes(self, numel: int) -> int:
        return math.ceil(numel / 8) + 4


class OneBitAllReduce(Compressor):
    """The average of a flat fp32 tensor of ``numel`` elements over the group, 1 bit per element each way.

    See the module docstring for the algorithm. ``all_reduce_(x)`` runs it synchronously on
    the caller's thread, on a process group of its own (no other collective interleaves).
    State, per rank: the worker error (``numel``) and this rank's server error (its chunk),
    both fp32, zeros until the first call; :meth:`state_dict` keeps them with the world
    size they belong to. ``stats`` counts what every codec's does: the fp32 bytes, the
    payload (the worker's packed chunks and scales) and the bytes sent in both phases.
    """

    def __init__(self, numel: int, process_group: dist.ProcessGroup | None = None):
        super().__init__(OneBit(), error_feedback=False, process_group=process_group)
        self.numel = numel
        self.bounds = shard_bounds(numel, self.world_size)
        sizes = [self.codec.wire_bytes(b - a) for a, b in self.bounds]
        self.spans = [(sum(sizes[:j]), sum(sizes[:j + 1])) for j in range(len(sizes))]  # of each chunk's payload
        self.widest = sizes[0]  # chunk 0 is never smaller: the all-gather's pieces are padded to it
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None

    def flat_buffer(self, device: torch.device) -> torch.Tensor:
        """An fp32 buffer of ``numel`` elements kept from call to call, for the caller to gather its tensor into."""
        return self._scratch("input", 0, self.numel, torch.float32, device)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Average ``x`` (flat fp32, ``numel``) over the group, compressed; the result is written into ``x``.

        Synchronous, but run on the channel's progress thread, not the caller's: [Note: no
        temporaries in the 1-bit all-reduce].
        """
        if x.numel() != self.numel or x.dtype != torch.float32:
            raise ValueError(f"1-bit all-reduce of {self.numel} fp32 elements got {x.numel()} {x.dtype}")
        return self._on_channel(lambda: self._reduce(x), lambda: x)

    def all_reduce_flag(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on every rank (a MIN all-reduce of one fp32), on the channel's progress thread."""
        verdict = torch.tensor([float(flag)], device=device)
        return bool(self._on_channel(lambda: dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.channel),
                                     lambda: verdict))

    def _on_channel(self, run: Callable[[], object], finish: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run`` then ``finish``: on the progress thread of this compressor's own group, waited for (inline alone)."""
        if self.world_size == 1:
            run()
            return finish()
        return progress_thread(self.channel).submit(run, finish).wait()

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._errors_like(x)
        sent = self._scratch(RUN, 1, self.spans[-1][1], torch.uint8, x.device)  # every chunk's payload, packed
        with self.stats.clock("encode"):
            z = self.worker_error.add_(x)  # the worker error becomes z, and then z's error
            chunks = [self.codec.encode_keeping_error_(z[a:b], out=sent[lo:hi])
                      for (a, b), (lo, hi) in zip(self.bounds, self.spans, strict=True)]
        mine, outgoing = self._serve(chunks, sent)
        self._gather(mine, outgoing, x)
        self._count(chunks, mine)
        return x

    def _errors_like(self, x: torch.Tensor) -> None:
        """Zeros at first; errors loaded from a checkpoint (read onto the CPU) moved to ``x``'s device."""
        if self.worker_error is not None and self.worker_error.device != x.device:
            self.worker_error, self.server_error = self.worker_error.to(x.device), self.server_error.to(x.device)
        if self.worker_error is None:
            a, b = self.bounds[self.rank]
            self.worker_error = torch.zeros_like(x)
            self.server_error = torch.zeros(b - a, dtype=x.dtype, device=x.device)

    def _serve(self, chunks: list[Encoded], sent: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """Phase 1 and the server's arithmetic: every rank's chunk ``rank``, averaged, compressed again into the
        first ``widest`` bytes (padding zeroed) of phase 2's outgoing buffer, returned with it."""
        mine = chunks[self.rank]
        sizes = [c.nbytes for c in chunks]
        device = sent.device
        received = self._scratch(RUN, 0, self.world_size * sizes[self.rank], torch.uint8, device)
        if self.world_size > 1:
            with self.stats.clock("communicate"):
                dist.all_to_all_single(received, sent, [sizes[self.rank]] * self.world_size, sizes,
                                       group=self.channel)
        else:
            received.copy_(sent)
        with self.stats.clock("decode"):
            size = sizes[self.rank]
            pieces = [unpack(received[i * size:(i + 1) * size], mine) for i in range(self.world_size)]
            total = self._scratch(RUN, 2, mine.numel, torch.float32, device)
            scratch = self._scratch(RUN, 3, mine.numel, torch.float32, device)
            sum_decoded(self.codec, pieces, total, scratch).div_(self.world_size)
            y = self.server_error.add_(total)  # the server error becomes y, and then y's error
            outgoing = self._scratch(RUN, 4, self.world_size * self.widest, torch.uint8, device)
            outgoing[size:self.widest].zero_()
            return self.codec.encode_keeping_error_(y, out=outgoing[:size]), outgoing

    def _gather(self, mine: Encoded, outgoing: torch.Tensor, out: torch.Tensor) -> None:
        """Phase 2: every server's compressed chunk (padded to the widest) to every rank, decoded into ``out``.

        An all-gather, sent as an all-to-all of ``outgoing``'s copies (its first ``widest`` bytes, this
        rank's piece, copied into every rank's slot): gloo's ``all_gather_into_tensor`` gathers into a
        temporary of its own, allocated on its thread at every call, which left the heap fragmented ([Note:
        no temporaries in the 1-bit all-reduce]); its all-to-all writes into the given buffers. The same
        bytes cross the wire: the N - 1 copies for the other ranks.
        """
        gathered = self._scratch(RUN, 5, self.world_size * self.widest, torch.uint8, out.device)
        copies = outgoing.view(self.world_size, self.widest)
        copies[1:].copy_(copies[0].expand(self.world_size - 1, -1))
        if self.world_size > 1:
            with self.stats.clock("communicate"):
                dist.all_to_all_single(gathered, outgoing, group=self.channel)
        else:
            gathered.copy_(outgoing)
        with self.stats.clock("decode"):
            for j, (a, b) in enumerate(self.bounds):
                signs = math.ceil((b - a) / 8)
                data = gathered[j * self.widest:j * self.widest + signs + 4]
                self.codec.decode(Encoded((data[:signs], data[signs:].clone().view(torch.float32)), b - a),
                                  out=out[a:b])

    def _count(self, chunks: list[Encoded], mine: Encoded) -> None:
        widest = self.widest
        payload = sum(c.nbytes for c in chunks)
        self.stats.raw_bytes += 4 * self.numel
        self.stats.payload_bytes += payload
        self.stats.sent_bytes += payload - chunks[self.rank].nbytes + (self.world_size - 1) * widest
        self.stats.buckets += 1

    def state_dict(self) -> dict:
        return {"worker_error": self.worker_error, "server_error": self.server_error,
                "world_size": self.world_size, "numel": self.numel}

    def load_state_dict(self, state: dict) -> None:
        """This rank's errors, saved on as many ranks for as many elements (else a ValueError: reset instead)."""
        if state["world_size"] != self.world_size or state["numel"] != self.numel:
            raise ValueError(f"1-bit errors saved for {state['numel']} elements on {state['world_size']} ranks do "
                             f"not fit {self.numel} on {self.world_size}; start them from zero")
        for name in ("worker_error", "server_error"):
            saved = state[name]
            setattr(self, name, None if saved is None else saved.clone())


def naive_onebit_all_reduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The oracle: the two-stage 1-bit average of ``x`` as fp32 arithmetic, whole tensors all-gathered.

    Updates ``worker_error`` (x's size) and ``server_error`` (this rank's chunk) in place and
    returns the average, a new tensor. Collectives: two ``all_gather``s of fp32 tensors.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = shard_bounds(x.numel(), world_size)
    z = x + worker_error
    sent = torch.empty_like(z)
    for a, b in bounds:
        s = torch.linalg.vector_norm(z[a:b]) / math.sqrt(max(b - a, 1))
        sent[a:b] = torch.where(z[a:b] >= 0, s, -s)
    worker_error.copy_(z - sent)
    everyone = [torch.empty_like(sent) for _ in range(world_size)]
    dist.all_gather(everyone, sent, group=group)
    a, b = bounds[rank]
    total = everyone[0][a:b].clone()
    for other in everyone[1:]:
        total += other[a:b]
    y = total / world_size + server_error
    s = torch.linalg.vector_norm(y) / math.sqrt(max(b - a, 1))
    served = torch.where(y >= 0, s, -s)
    server_error.copy_(y - served)
    widest = bounds[0][1] - bounds[0][0]
    padded = torch.zeros(widest, dtype=x.dtype, device=x.device)
    padded[:b - a] = served
    chunks = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(chunks, padded, group=group)
    return torch.cat([chunks[j][:hi - lo] for j, (lo, hi) in enumerate(bounds)])
