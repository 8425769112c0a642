"""The accumulating micro-step's cost, three forms, refitted to the second study's probes and scored (docs/tune.md).

    python docs/repro/tune_microstep_form.py base|compute|fwd bench_results/tune2/local-exhaustive ...

``base``: a constant per micro-step that accumulates without reducing (``per_micro_step_s``, as dptrain's simulator
charges it); ``compute``: instead, a share of those micro-steps' profiled forward and backward; ``fwd``: of their
forward. Each setting's calibration is refitted with the form (docs/repro/tune_refit.py: nothing is measured again)
and its exhaustive search scored against it (docs/repro/tune_rescore.py).
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_rescore import refitted, summary  # noqa: E402

import dptrain.planner.simulate as sim  # noqa: E402
import dptrain.tune.calibrate as calmod  # noqa: E402
import dptrain.tune.tuner as tunermod  # noqa: E402

MODE = sys.argv[1]
original = sim.simulate_step


def patched(*args, **kwargs):
    """The simulator's step with feature 8 (the accumulating micro-steps) in ``MODE``'s form."""
    overheads = kwargs.pop("overheads", None)
    p = original(*args, **kwargs)
    f = list(p.features)
    if MODE == "compute":
        f[8] = (p.accum - 1) * (p.forward_s + p.backward_s)
    elif MODE == "fwd":
        f[8] = (p.accum - 1) * p.forward_s
    o = sum(x * y for x, y in zip((overheads or sim.Overheads()).terms(), f, strict=True))
    return dataclasses.replace(p, features=tuple(f), overhead_s=o, step_s=p.step_s + o)


def main() -> None:
    calmod.simulate_step = tunermod.simulate_step = patched
    for name in sys.argv[2:]:
        d = Path(name)
        cal, rows = refitted(d, d)
        fit = max(abs(r["ratio"] - 1) for r in cal.residuals())
        print(f"{MODE:8s} {d.name}: micro-step term {cal.overheads.per_micro_step_s:.4g}, compute share "
              f"{cal.overheads.compute_slowdown:.3f}, probes' fit worst {fit:.3f} | {summary(rows)}")

if __name__ == "__main__":
    main()
