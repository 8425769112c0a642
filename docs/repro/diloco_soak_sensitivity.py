"""What tests/test_diloco_memory.py's soak can see: its measurement, with a tensor of LEAK bytes kept per sync point.

    python docs/repro/diloco_soak_sensitivity.py WIDTH LEAK      # e.g. 128 8192; LEAK 0 is the test as it runs

For each of the test's two DiLoCo settings, per rank: the heap in use grown (MiB), the resident set grown (MiB),
the bytes of Python objects still alive (tracemalloc), and the seconds of the warm-up and of the measured steps.
The test's bounds: heap under 1 MiB, objects under 32 KiB.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from _memory import heap_mib, resident_mib  # noqa: E402
from dptrain.diloco import DiLoCo  # noqa: E402
from dptrain.testing import run_on_ranks  # noqa: E402

SETTINGS = [dict(period=4, fragments=2, overlap_steps=1, compression="e3m0"), dict(period=2, compression="int8")]


def soak(rank: int, world_size: int, options: dict, width: int, leak: int, steps: int = 600) -> tuple:
    import gc
    import tracemalloc

    torch.manual_seed(0)
    wrapper = DiLoCo(nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)), **options)
    opt = torch.optim.SGD(wrapper.module.parameters(), lr=1e-3)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
    kept, taken = [], [0]

    def step() -> None:
        wrapper(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        wrapper.after_optimizer_step()
        wrapper.step_metrics()
        taken[0] += 1
        if leak and taken[0] % options["period"] == 0:
            kept.append(torch.empty(leak // 4))  # the fault: a payload kept per sync point

    t0 = time.perf_counter()
    for _ in range(150):
        step()
    tracemalloc.start()
    for _ in range(300):
        step()
    gc.collect()
    before, heap, rss = tracemalloc.get_traced_memory()[0], heap_mib(), resident_mib()
    t1 = time.perf_counter()
    for _ in range(steps):
        step()
    gc.collect()
    return (round(heap_mib() - heap, 3), round(resident_mib() - rss, 1), tracemalloc.get_traced_memory()[0] - before,
            round(t1 - t0, 1), round(time.perf_counter() - t1, 1))


if __name__ == "__main__":
    width, leak = int(sys.argv[1]), int(sys.argv[2])
    for options in SETTINGS:
        t0 = time.perf_counter()
        ranks = run_on_ranks(soak, 2, options, width, leak, env={"TORCH_FR_BUFFER_SIZE": "0"}, timeout=300)
        print(f"width {width} leak {leak} B {options}: {time.perf_counter() - t0:.1f} s; per rank (heap MiB, "
              f"resident MiB, object bytes, warm-up s, measured s): {ranks}")
