"""Each calibration's predicted / measured on a search, the 1 MiB rows against the 25 MiB rows (docs/tune.md).

    python docs/repro/tune_rows_by_size.py [--own-profiles] EXHAUSTIVE_DIR:CALIBRATED_DIR ...

Refits each calibration with the simulator on PYTHONPATH (``tune_rescore.refitted``: nothing measured again) and
prints the median and range of its rows at each bucket size: a cost per bucket the calibration misses shows as the
small buckets' rows below the large ones'. ``--own-profiles``: the tuned model's profile timed with the calibration.
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_rescore import refitted  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "bench_results"

if __name__ == "__main__":
    own = "--own-profiles" in sys.argv
    for pair in (a for a in sys.argv[1:] if a != "--own-profiles"):
        search, calibrated = pair.split(":")
        _, rows = refitted(RESULTS / search, RESULTS / calibrated, own_profiles=own)
        sizes = {k: [r["now"] for r in rows if f" {k}MiB" in r["candidate"]] for k in ("1", "25")}
        print(f"{search} <- {calibrated}: " + ", ".join(
            f"{k} MiB {statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f}, {len(v)} rows)" for k, v in sizes.items()))
