"""Earlier calibrations refitted by the simulator on PYTHONPATH, each scored on its setting's exhaustive search.

    python docs/repro/tune_refit_scores.py [--own-profiles] [EXHAUSTIVE_DIR:CALIBRATED_DIR ...]   # default: PAIRS below

For each pair: the calibration's probe runs refitted (``tune_rescore.refitted``: nothing measured again), then every
configuration the search measured predicted; prints the mean and largest error, the rows within 10%, the mean
predicted / measured of each family (DDP, plain ZeRO, hybrid ZeRO) with its range, and the tuner's pick (the best by
the search's medians of the three predicted fastest, over the optimum). Run it twice, under two commits'
``src`` on PYTHONPATH, to see what a change to the simulator's form does to every calibration at once.
``--own-profiles``: each calibration with the tuned model's profile timed in its own job (tune_rescore.py's flag).
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_rescore import own_profiles_flag, refitted  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "bench_results"
# The calibrations whose probe-model profiles are kept (bench_results' calibration/probe*/, since tune25): those of
# tune2-tune24 were lost with the machine's ignored files and can only be scored as fitted (tune_rescore.py).
PAIRS = [f"{s}:{c}" for s, cs in (
    ("tune25/space-4x1-10-exhaustive", ("tune25/space-4x1-10-tuner", "tune25/space-4x1-10-exhaustive")),
    ("tune25/space-2x2-10-exhaustive", ("tune25/space-2x2-10-tuner", "tune25/space-2x2-10-exhaustive")),
) for c in cs]


def family(candidate: str) -> str:
    return "hybrid" if "hybrid" in candidate else ("ddp" if candidate.startswith("ddp") else "zero")


def score(pair: str, own_profiles: bool = False) -> str:
    search, calibrated = pair.split(":")
    _, rows = refitted(RESULTS / search, RESULTS / calibrated, own_profiles=own_profiles)
    errs = [abs(r["now"] - 1) for r in rows]
    fastest = sorted(rows, key=lambda r: r["now"] * r["measured_s"])[:3]
    pick = min(r["measured_s"] for r in fastest) / min(r["measured_s"] for r in rows)
    fams = []
    for f in ("ddp", "zero", "hybrid"):
        v = [r["now"] for r in rows if family(r["candidate"]) == f]
        if v:
            fams.append(f"{f} {statistics.mean(v):.3f} ({min(v):.2f}-{max(v):.2f})")
    return (f"{search.replace('-exhaustive', '')} <- {calibrated}: mean {100 * statistics.mean(errs):.1f}%, "
            f"max {100 * max(errs):.1f}%, within 10% {sum(e <= 0.10 for e in errs)}/{len(errs)}, pick {pick:.3f} | "
            + ", ".join(fams))


if __name__ == "__main__":
    own, pairs = own_profiles_flag(sys.argv[1:])
    for pair in pairs or PAIRS:
        print(score(pair, own), flush=True)
