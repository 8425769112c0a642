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

import dataclasses
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
    """``fit_overheads``' fit, less the terms it cannot tell from zero, one at a time: a dropped term's feature is
    zeroed in every probe, which ``fit_overheads`` holds at zero as unidentified, and the rest is fitted again."""
    dropped: set[int] = set()
    while True:
        runs = [dataclasses.replace(p, features=tuple(0.0 if k in dropped else f for k, f in enumerate(p.features)))
                for p in probes]
        fit = FIT(runs)
        kept = [k for k, v in enumerate(fit.terms()) if v]
        if not kept:
            return fit
        X, y = calibration._matrix(runs)
        A = X[:, kept]
        err = float(np.sum((A @ np.array([fit.terms()[k] for k in kept]) - y) ** 2))
        cov = err / max(1, len(y) - len(kept)) * np.linalg.pinv(A.T @ A)
        t = [fit.terms()[k] / max(1e-30, float(np.sqrt(cov[i, i]))) for i, k in enumerate(kept)]
        if min(t) >= T_MIN:
            return fit
        dropped.add(kept[int(np.argmin(t))])


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
        predicted = errors(cal, trials, cal.overheads)
        fastest = sorted(range(len(trials)), key=lambda i: trials[i].measured_s * (1 + predicted[i]))
        for k in (3, 5):
            rest = [trials[i] for i in fastest[k:]]
            out = [f"probes {mean_within(errors(cal, rest, cal.overheads))}"]
            for weight in (1, 3, 10):
                fit = FIT(list(cal.probes) + [trials[i] for i in fastest[:k]] * weight)
                out.append(f"x{weight} {mean_within(errors(cal, rest, fit))}")
            print(f"{name}, {k} finalists added, the other {len(rest)}: " + "; ".join(out))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("pruned", "finalists"):
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
