"""Why dptrain.comm reuses scratch buffers: a fresh large receive buffer page-faults every call.

Two gloo ranks exchange half of a 64 MiB float32 tensor, interleaved, 6 repetitions,
median of the slower rank; prints milliseconds for

- native: gloo's all-reduce of the 64 MiB tensor;
- ring: dptrain's ring all-reduce of it (scratch reused across calls);
- whole: one 32 MiB send + receive into a reused buffer;
- pieces: the same 32 MiB as 8 messages of 4 MiB (pipelined pieces);
- fresh: the same as whole, into a buffer allocated for each call.

    python docs/repro/fresh_receive_buffer.py
"""

import statistics
import time

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.testing import run_on_ranks


def _measure(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    n = 16 * 1024 * 1024
    x, half, peer = torch.ones(n), n // 2, 1 - rank
    mine = x[:half] if rank else x[half:]
    reused = torch.zeros(half)

    def exchange(into: torch.Tensor, pieces: int = 1) -> None:
        step = half // pieces
        works = [dist.isend(mine[i * step:(i + 1) * step], peer) for i in range(pieces)]
        works += [dist.irecv(into[i * step:(i + 1) * step], peer) for i in range(pieces)]
        for w in works:
            w.wait()

    variants = {"native": lambda: dist.all_reduce(x),
                "ring": lambda: comm.all_reduce(x, algorithm="ring", validate=False),
                "whole": lambda: exchange(reused), "pieces": lambda: exchange(reused, 8),
                "fresh": lambda: exchange(torch.empty(half))}
    times = {k: [] for k in variants}
    for _ in range(6):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    per_rank = run_on_ranks(_measure, 2, timeout=600)
    for name in per_rank[0]:
        slowest = [max(r[name][i] for r in per_rank) for i in range(6)]
        print(f"{name:>7}: {statistics.median(slowest) * 1e3:6.1f} ms")
