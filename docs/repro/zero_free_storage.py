"""ZeRO-2 with and without freeing each reduced gradient when it is waited for, alternated in one process pair.

Issue 46 (item 10): ``UnitReduction`` frees a reduce-scatter's full-size input with
``free_storage`` (``resize_(0)``) right after waiting for it. On a loaded machine whole
benchmark runs swing more than that change could; this pairs adjacent steps instead: the
bench's 7.5M GPT (``dptrain bench zero``'s) under ZeRO-2 on 2 ranks, one thread each, the
allocator tuned as the bench tunes it, in blocks of four steps ordered ABBA: A with
``free_storage``, B with it replaced by a no-op (the old behaviour: the storage goes when
the last holder drops it); each A is paired with the B beside it. The slowest rank's step::

    PYTHONPATH=src nice -n 19 python docs/repro/zero_free_storage.py

prints both medians, the median of the paired ratios (with / without) and their geometric mean.
"""

import math
import statistics
import time

import torch

from dptrain.allocator import tune_cpu_allocator
from dptrain.models.gpt import GPT
from dptrain.optim.build import decays
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO, reduction

BLOCKS, WARMUP = 80, 4


def _steps(rank: int, world_size: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    tune_cpu_allocator()
    torch.manual_seed(0)
    model = ZeRO(GPT(n_layer=6, n_head=5, n_embd=320, block_size=32), stage=2, split_by=decays)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    free = reduction.free_storage
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"free": [], "no free": []}
    for step in range(WARMUP + 4 * BLOCKS):
        mode = "free" if step < WARMUP or (step - WARMUP) % 4 in (0, 3) else "no free"  # ABBA
        reduction.free_storage = free if mode == "free" else (lambda tensor: None)
        x = torch.randint(0, 256, (2, 32), generator=g)
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        took = torch.tensor([time.perf_counter() - start])
        torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's step
        if step >= WARMUP:
            times[mode].append(took.item())
    reduction.free_storage = free
    return times


if __name__ == "__main__":
    times = run_on_ranks(_steps, 2, timeout=600)[0]
    ratios = [a / b for a, b in zip(times["free"], times["no free"], strict=True)]  # A0/B1, A3/B2 of each block
    print(f"with free_storage {statistics.median(times['free']) * 1e3:.1f} ms, without "
          f"{statistics.median(times['no free']) * 1e3:.1f} ms; {len(ratios)} paired ratios: median "
          f"{statistics.median(ratios):.3f}, geometric mean {math.exp(statistics.fmean(map(math.log, ratios))):.3f}")
