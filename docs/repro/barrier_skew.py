"""How far apart local ranks leave a barrier: the alignment error of barrier-zeroed clocks.

    python docs/repro/barrier_skew.py

Each of 50 trials: barrier, read time.perf_counter() (one monotonic clock for every
process on a machine), gather; the skew is max - min. dptrain's trace shares rank 0's
zero on one machine and falls back to barrier-zeroed clocks across machines.
"""

import statistics
import time

import torch.distributed as dist

from dptrain.testing import run_on_ranks


def _skews(rank: int, world_size: int) -> list[float]:
    skews = []
    for _ in range(50):
        dist.barrier()
        now = time.perf_counter()
        readings = [None] * world_size
        dist.all_gather_object(readings, now)
        skews.append(max(readings) - min(readings))
    return skews


if __name__ == "__main__":
    for world_size in (2, 4):
        skews = run_on_ranks(_skews, world_size)[0]
        print(f"{world_size} ranks: median {1e3 * statistics.median(skews):.2f} ms, worst {1e3 * max(skews):.2f} ms")
