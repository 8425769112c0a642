"""The simulator's overhead terms fitted to an exhaustive search's trials themselves: the form's ceiling (docs/tune.md).

    python docs/repro/tune_form_ceiling.py [--own-profiles] [--form base|inside|after|rounds|hosts] \
        EXHAUSTIVE_DIR:CALIBRATION_DIR ...

A calibration fits the twelve terms to its probes and is scored against trials it never saw. When the trials miss,
either the probes do not identify the terms (a term's feature moves with another's across the probes, but apart in
the trials) or no values of the terms fit the trials at all (a cost the form lacks). This tells the two apart: the
search's trials are replayed without overheads on ``CALIBRATION_DIR``'s links (its ``calibration.json``), and the
terms fitted to them by the calibration's own rule (``fit_overheads``): in sample, the smallest error the form
reaches on these trials; leaving each trial out in turn, what a fit to the other 27 predicts for it. Beside each,
the probes' own fit (the calibration's terms) and what the trials' fit would do to the probes. Nothing is measured.
Without ``--form`` the simulator's twelve terms; with it, a thirteenth of docs/repro/tune_contention_form.py's (the
calibration then refitted with it first). ``--own-profiles``: the trials replayed on the tuned model's compute profile
timed with ``CALIBRATION_DIR``'s calibration (tune_rescore.py's flag), not the search's own.
"""

import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tune_contention_form as forms  # noqa: E402
from tune_rescore import own_profiles_flag, refitted, rescore  # noqa: E402

import dptrain.planner.simulate as sim  # noqa: E402
import dptrain.tune.tuner as tunermod  # noqa: E402
from dptrain.planner.calibration import Calibration, ProbeRun, fit_overheads  # noqa: E402


def trial_runs(search: Path, calibration: Path, work: Path,
               profiles: Path | None = None) -> tuple[list[ProbeRun], list[float]]:
    """Each measured candidate of ``search`` as a probe (its median, its timeline without overheads, its features),
    and each one's own spread between repeats; ``profiles``: the directory whose profiles.json replays them."""
    captured = []
    original = tunermod.simulate_step

    def capture(*args, **kwargs):
        captured.append(original(*args, **kwargs))
        return captured[-1]

    bare = dataclasses.replace(Calibration.load(calibration), overheads=sim.Overheads())
    bare_path = work / "bare.json"
    bare.save(bare_path)
    tunermod.simulate_step = capture
    try:
        rows = rescore(search, bare_path, profiles)
    finally:
        tunermod.simulate_step = original
    if len(captured) != len(rows):
        raise SystemExit(f"{search}: {len(captured)} timelines for {len(rows)} rows (a periodic strategy's?)")
    return ([ProbeRun(r["candidate"], r["measured_s"], p.step_s, p.features) for r, p in zip(rows, captured, strict=True)],
            [r["spread"] for r in rows])


def errors(cal: Calibration, runs: list[ProbeRun], overheads: sim.Overheads) -> list[float]:
    """Each run's predicted / measured - 1 with ``overheads`` on ``cal``'s links (``Calibration.residuals``)."""
    return [r["ratio"] - 1 for r in dataclasses.replace(cal, probes=runs, overheads=overheads).residuals()]


def line(name: str, errs: list[float], spreads: list[float] | None = None) -> str:
    """The errors' mean, largest, how many are within 10% and, given each run's spread, how many meet the goal."""
    a = [abs(e) for e in errs]
    met = "" if spreads is None else f", goal met {sum(e <= max(0.1, s) for e, s in zip(a, spreads, strict=True))}"
    return (f"{name}: mean {100 * statistics.mean(a):.1f}% max {100 * max(a):.1f}% within 10% "
            f"{sum(e <= 0.1 for e in a)}/{len(a)}{met}")


def main(argv: list[str]) -> None:
    form = None
    own, argv = own_profiles_flag(argv)
    if argv[:1] == ["--form"]:
        form, argv = argv[1], argv[2:]
        forms.use_form(form)
    for pair in argv:
        search, tuned = (Path(p) for p in pair.split(":"))
        if form is None:
            cal = Calibration.load(tuned / "calibration.json")
        else:
            cal, _ = refitted(search, tuned)
        with tempfile.TemporaryDirectory() as work:
            cal.save(Path(work) / "calibration.json")
            trials, spreads = trial_runs(search, Path(work) / "calibration.json", Path(work), tuned if own else None)
        inside = fit_overheads(trials)
        left_out = [errors(cal, [t], fit_overheads(trials[:i] + trials[i + 1:]))[0] for i, t in enumerate(trials)]
        print(f"{search.name} on {tuned}{'' if form is None else f', form {form}'}{', its own profile' if own else ''}:")
        print("  " + line("probes' fit on the trials", errors(cal, trials, cal.overheads), spreads))
        print("  " + line("trials' fit on the trials (in sample)", errors(cal, trials, inside), spreads))
        print("  " + line("trials' fit, each trial left out", left_out, spreads))
        print("  " + line("trials' fit on the probes", errors(cal, cal.probes, inside)))
        print("  " + line("probes' fit on the probes", errors(cal, cal.probes, cal.overheads)))
        for name, a, b in zip(sim.Overheads.names(), cal.overheads.terms(), inside.terms(), strict=True):
            if a or b:
                print(f"    {name:24s} probes {a:.4g}  trials {b:.4g}")
        for name, errs in (("in sample", errors(cal, trials, inside)), ("left out", left_out)):
            worst = sorted(zip(trials, errs, spreads, strict=True), key=lambda x: -abs(x[1]))[:4]
            print(f"    {name}, worst: " + "; ".join(f"{t.label} {1 + e:.3f} (spread {100 * s:.1f}%)"
                                                     for t, e, s in worst))


if __name__ == "__main__":
    main(sys.argv[1:])
