"""Probes of the tuned model itself, fitted beside the probe models' and scored on the rows they leave out (docs/tune.md).

    python docs/repro/tune_target_probe.py [--own-profiles] [--weight W] [--set ddp|ddp+zero|ddp+zero+z3] \\
        EXHAUSTIVE_DIR:CALIBRATION_DIR ...

The calibration fits its terms to runs of two small probe models; the trials of a search are of the model being
tuned. Fitted to the trials themselves (tune_form_ceiling.py) the terms want per-collective costs several times the
probes' at 10 Gbit/s: the probe models do not show what a collective costs beside the tuned model's compute. This asks
what a calibration would gain by running a few configurations of the tuned model among its probes: the search's
measured median of each chosen configuration (the largest micro-batch without accumulation; DDP at the smallest and
the largest bucket, then ZeRO-1 at the smallest, then ZeRO-3) is added to the calibration's probes, counted ``W``
times (the probes number about 30), the terms fitted again by the calibration's own rule (``fit_overheads``), and
every *other* row of the search scored. Nothing is measured: the added runs stand for probes the calibration would
make, here taken from the search (so they carry its two runs' median, not a 6-step probe's noise).
"""

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_form_ceiling import errors, line, trial_runs  # noqa: E402
from tune_rescore import own_profiles_flag  # noqa: E402

from dptrain.planner.calibration import Calibration, fit_overheads  # noqa: E402

SETS = {"ddp": ("ddp", "ddp"), "ddp+zero": ("ddp", "ddp", "zero1"), "ddp+zero+z3": ("ddp", "ddp", "zero1", "zero3")}


def targets(labels: list[str], which: str) -> list[str]:
    """The labels of the configurations probed: the largest micro-batch without accumulation (``Nx1``), DDP at the
    smallest and largest bucket, ZeRO-1 at the smallest, ZeRO-3; no codec, no hybrid sharding."""
    plain = [label for label in labels if "/" not in label and len(label.split()) <= 3]
    micro = max(int(label.split()[1].split("x")[0]) for label in plain if label.split()[1].endswith("x1"))
    mine = [label for label in plain if label.split()[1] == f"{micro}x1"]

    def mib(label: str) -> float:
        return float(label.split()[2].removesuffix("MiB"))

    ddp = sorted((label for label in mine if label.startswith("ddp ")), key=mib)
    out = [ddp[0], ddp[-1]]
    if "zero" in which:
        out.append(min((label for label in mine if label.startswith("zero1 ")), key=mib))
    if "z3" in which:
        out += [label for label in mine if label.startswith("zero3 ")]
    return out


def main(argv: list[str]) -> None:
    own, argv = own_profiles_flag(argv)
    weight, which = 1, "ddp"
    while argv and argv[0] in ("--weight", "--set"):
        if argv[0] == "--weight":
            weight = int(argv[1])
        else:
            which = argv[1]
        argv = argv[2:]
    for pair in argv:
        search, tuned = (Path(p) for p in pair.split(":"))
        cal = Calibration.load(tuned / "calibration.json")
        with tempfile.TemporaryDirectory() as work:
            cal.save(Path(work) / "calibration.json")
            trials, spreads = trial_runs(search, Path(work) / "calibration.json", Path(work), tuned if own else None)
        chosen = targets([t.label for t in trials], which)
        probed = [t for t in trials if t.label in chosen]
        rest = [(t, s) for t, s in zip(trials, spreads, strict=True) if t.label not in chosen]
        fitted = fit_overheads(cal.probes + probed * weight)
        held, held_spreads = [t for t, _ in rest], [s for _, s in rest]
        print(f"{search.parent.name}/{search.name} <- {tuned.parent.name}/{tuned.name}"
              f"{', own profile' if own else ''}; probed: {', '.join(chosen)} (x{weight})")
        print("  " + line(f"the other {len(held)} rows, the calibration as fitted",
                          errors(cal, held, cal.overheads), held_spreads))
        print("  " + line(f"the other {len(held)} rows, with the tuned model probed",
                          errors(cal, held, fitted), held_spreads))
        probe_errs = errors(cal, cal.probes, fitted)
        print(f"  the probe models' runs, refitted: mean {100 * statistics.mean(abs(e) for e in probe_errs):.1f}%; "
              f"the tuned model's probes: {', '.join(f'{1 + e:.3f}' for e in errors(cal, probed, fitted))}")


if __name__ == "__main__":
    main(sys.argv[1:])
