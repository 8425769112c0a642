"""What tests/test_diloco_memory.py's soak can see: its measurement, with a tensor of LEAK bytes kept per sync point.

    python docs/repro/diloco_soak_sensitivity.py WIDTH LEAK      # e.g. 128 8192; 128 0 is the test as it runs

For each of the test's two DiLoCo settings, per rank: the heap in use grown (MiB), the resident set grown (MiB) and
the bytes of Python objects still alive (tracemalloc), from the test's own ``_soak``; and the seconds the two ranks
took. The test's bounds: heap under 1 MiB, objects under 32 KiB.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from dptrain.testing import run_on_ranks  # noqa: E402
from test_diloco_memory import _soak  # noqa: E402

SETTINGS = [dict(period=4, fragments=2, overlap_steps=1, compression="e3m0"), dict(period=2, compression="int8")]

if __name__ == "__main__":
    width, leak = int(sys.argv[1]), int(sys.argv[2])
    for options in SETTINGS:
        t0 = time.perf_counter()
        ranks = run_on_ranks(_soak, 2, options, 600, width, leak, env={"TORCH_FR_BUFFER_SIZE": "0"}, timeout=300)
        print(f"width {width} leak {leak} B {options}: {time.perf_counter() - t0:.1f} s; per rank (heap MiB, "
              f"resident MiB, object bytes): {ranks}")
