"""Two changes to how the overhead terms are fitted, scored on earlier searches (docs/tune.md, the sixth pass).

    python docs/repro/tune_fit_variants.py pruned EXHAUSTIVE_DIR:CALIBRATION_DIR ...
    python docs/repro/tune_fit_variants.py finalists EXHAUSTIVE_DIR:CALIBRATION_DIR ...

``pruned``: the calibration's own fit (``fit_overheads``), then the term whose coefficient is the fewest standard
errors from zero dropped while that is under two, and the rest fitted again; each calibration refitted so, and the
search scored against it beside the calibration as it was. ``finalists``: what a tuner would have if it refitted with
its own trials: the three and the five configurations the calibration predicts fastest, measured (the search's
medians), added to the probes once, three and ten times over, and the other configurations scored against the fit,
beside the probes' fit on the same ones. Nothing is measured.
"""

import itertools
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from tune_form_ceiling import errors, trial_runs  # noqa: E402
from tune_rescore import refitted, summary  # noqa: E402

import dptrain.planner.calibration as calibration  # noqa: E402
import dptrain.tune.calibrate as calmod  # noqa: E402

T_MIN = 2.0  # a term fewer standard errors than this from zero is dropped
FIT = calibration.fit_overheads  # the calibration's own fit


def pruned_fit(probes):
    """``fit_overheads``' best non-negative subset, less the terms it cannot tell from zero, one at a time."""
    X, y = calibration._matrix(probes)
    n = X.shape[1]
    free = [k for k, ok in enumerate(calibration._identified(X)) if ok]
    while True:
        best, best_err, kept = np.zeros(n), float(np.sum(y ** 2)), ()
        for size in range(1, len(free) + 1):
            for cols in itertools.combinations(free, size):
                coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
                err = float(np.sum((X[:, cols] @ coef - y) ** 2))
                if not np.any(coef < 0) and err < best_err - 1e-15:
                    best, best_err, kept = np.zeros(n), err, cols
                    best[list(cols)] = coef
        if not kept:
            break
        A = X[:, kept]
        cov = best_err / max(1, len(y) - len(kept)) * np.linalg.pinv(A.T @ A)
        t = [best[c] / max(1e-30, float(np.sqrt(cov[i, i]))) for i, c in enumerate(kept)]
        if min(t) >= T_MIN:
            break
        free.remove(kept[int(np.argmin(t))])
    return calibration.Overheads(*(float(v) for v in best))


def mean_within(errs: list[float]) -> str:
    a = [abs(e) for e in errs]
    return f"{100 * statistics.mean(a):.1f}% ({sum(e <= 0.1 for e in a)}/{len(a)})"


def main(mode: str, pairs: list[str]) -> None:
    for pair in pairs:
        search, tuned = (Path(p) for p in pair.split(":"))
        name = f"{search.name.removesuffix('-exhaustive')} on {tuned.parent.name}/{tuned.name}"
        if mode == "pruned":
            print(f"{name}, as fitted: {summary(refitted(search, tuned)[1]).splitlines()[0]}")
            calibration.fit_overheads = calmod.fit_overheads = pruned_fit
            cal, rows = refitted(search, tuned)
            calibration.fit_overheads = calmod.fit_overheads = FIT
            print(f"{name}, pruned: {summary(rows).splitlines()[0]} | kept: "
                  + ", ".join(k for k, v in zip(cal.overheads.names(), cal.overheads.terms(), strict=True) if v))
            continue
        cal = calibration.Calibration.load(tuned / "calibration.json")
        with tempfile.TemporaryDirectory() as work:
            trials, _ = trial_runs(search, tuned / "calibration.json", Path(work))
        predicted = errors(trials, cal.overheads)
        fastest = sorted(range(len(trials)), key=lambda i: trials[i].measured_s * (1 + predicted[i]))
        for k in (3, 5):
            rest = [trials[i] for i in fastest[k:]]
            out = [f"probes {mean_within(errors(rest, cal.overheads))}"]
            for weight in (1, 3, 10):
                fit = FIT(list(cal.probes) + [trials[i] for i in fastest[:k]] * weight)
                out.append(f"x{weight} {mean_within(errors(rest, fit))}")
            print(f"{name}, {k} finalists added, the other {len(rest)}: " + "; ".join(out))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("pruned", "finalists"):
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
