"""An exhaustive search's measured medians against another calibration's predictions (docs/tune.md).

    python docs/repro/tune_rescore.py EXHAUSTIVE_DIR CALIBRATION.json [--markdown] [--own-profiles]

The runs of an exhaustive search (``dptrain tune --exhaustive --rounds 3``) stand; the simulator predicts every
measured candidate again with ``CALIBRATION`` (the same setting's links and overheads measured anew, e.g. by a tuner
run without ``--calibration``) and the search's own compute profiles. Prints each candidate's new prediction /
measured median and whether it meets the goal (within 10% of the median, or within its own spread where larger),
beside the search's original prediction, then the summary. It reads the search's model.toml, profiles.json and
tune.json only. ``--own-profiles``: the compute profiles measured with CALIBRATION (the profiles.json beside it, the
tuned model's, timed in the calibration's job) in place of the search's, so that the links, the overheads and the
profile they were fitted with are one measurement, as the tuner predicts: where the machine's speed moved between
the two jobs, the search's profile and another calibration's overheads disagree by that much.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from dptrain.planner.calibration import Calibration
from dptrain.tune.compute_probe import profile_from_dict
from dptrain.tune.space import candidates
from dptrain.tune.tuner import predictor


def searched(search_dir: Path, profiles_dir: Path | None = None) -> tuple[dict, dict, dict]:
    """A search's tune.json, its compute profiles by micro-batch (``profiles_dir``'s where given), and its
    candidates by label."""
    t = json.loads((search_dir / "tune.json").read_text())
    o = t["options"]
    raw = json.loads(((profiles_dir or search_dir) / "profiles.json").read_text())
    profiles = {int(m): profile_from_dict(p) for m, p in raw.items()}
    shard_sizes = None if o["shard_sizes"] is None else [int(k) for k in str(o["shard_sizes"]).split(",") if k != "0"]
    space = candidates(t["world_size"], o["global_batch"], o["strategies"].split(","),
                       [int(m) for m in o["micro_batches"].split(",")] if o["micro_batches"] else None,
                       [float(b) for b in o["buckets"].split(",")], shard_sizes, o["codecs"].split(","))
    return t, profiles, {c.label: c for c in space}


def rescore(search_dir: Path, calibration_path: Path, profiles_dir: Path | None = None) -> list[dict]:
    t, profiles, by_label = searched(search_dir, profiles_dir)
    predict = predictor(search_dir / "model.toml", [], t["world_size"], Calibration.load(calibration_path), profiles)
    out = []
    for r in t["rows"]:
        if not r["measured_s"]:
            continue
        new = predict(by_label[r["candidate"]])
        spread = r.get("spread") or 0.0
        out.append({"candidate": r["candidate"], "measured_s": r["measured_s"], "spread": spread,
                    "was": r["predicted_s"] / r["measured_s"], "now": new / r["measured_s"],
                    "meets": abs(new / r["measured_s"] - 1) <= max(0.10, spread)})
    return out


def refitted(search_dir: Path, tuned_dir: Path, models=None, own_profiles: bool = False) -> tuple:
    """``tuned_dir``'s calibration refitted by today's simulator (``dptrain.tune.calibrate.refit``: nothing measured
    again) and the exhaustive search in ``search_dir`` scored against it: the calibration and :func:`rescore`'s rows.
    ``models``: the probe models whose runs count (default the ones that calibration probed); ``own_profiles``: the
    tuned model's profiles measured with that calibration (``tuned_dir``'s), not the search's."""
    import tempfile

    from dptrain.tune.calibrate import refit
    with tempfile.TemporaryDirectory() as work:
        cal = refit(tuned_dir / "calibration.json", Path(work), log=lambda s: None, models=models)
        cal.save(Path(work) / "c.json")
        return cal, rescore(search_dir, Path(work) / "c.json", tuned_dir if own_profiles else None)


def probes_choose(pairs: list[str], values: list[float], apply, describe, unit: str = "") -> None:
    """A form with a parameter the fit cannot take (not linear in the step), studied on ``pairs`` (each
    ``EXHAUSTIVE_DIR:CALIBRATION_DIR``): for each value, ``apply(value)``, the calibration refitted
    (:func:`refitted`) and a line, ``describe(value, the probes' mean error, calibration, rows)``; then the value
    whose probes' mean error is the smallest, the one a calibration would choose."""
    for pair in pairs:
        search, tuned = (Path(p) for p in pair.split(":"))
        print(f"{search.parent.name}/{search.name} <- {tuned.parent.name}/{tuned.name}")
        chosen = None
        for value in values:
            apply(value)
            cal, rows = refitted(search, tuned)
            probes = statistics.mean(abs(r["ratio"] - 1) for r in cal.residuals())
            print("  " + describe(value, probes, cal, rows))
            if chosen is None or probes < chosen[0] - 1e-4:
                chosen = (probes, value)
        print(f"  the probes choose {chosen[1]}{unit}")


def summary(rows: list[dict]) -> str:
    """The rows' mean and largest error, and how many are within 10% and meet the goal."""
    errs = [abs(r["now"] - 1) for r in rows]
    worst = sorted(rows, key=lambda r: -abs(r["now"] - 1))[:4]
    return (f"mean {100 * statistics.mean(errs):.1f}% max {100 * max(errs):.1f}% within 10% "
            f"{sum(e <= 0.1 for e in errs)}/{len(errs)} goal met {sum(r['meets'] for r in rows)}\n   worst: "
            + "; ".join(f"{r['candidate']} {r['now']:.3f}" for r in worst))


def own_profiles_flag(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether ``--own-profiles`` is among ``argv``, and the arguments without it (the study scripts' shared flag)."""
    return "--own-profiles" in argv, [a for a in argv if a != "--own-profiles"]


def main(argv: list[str]) -> None:
    own, argv = own_profiles_flag(argv)
    calibration = Path(argv[1])
    rows = rescore(Path(argv[0]), calibration, calibration.parent if own else None)
    print("| candidate | measured ms (median) | spread | predicted / measured, before | now | goal |\n"
          "|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['candidate']} | {r['measured_s'] * 1e3:.1f} | {100 * r['spread']:.1f}% | {r['was']:.3f} | "
              f"{r['now']:.3f} | {'met' if r['meets'] else 'missed'} |")
    for key in ("was", "now"):
        errors = [abs(r[key] - 1) for r in rows]
        print(f"\n{'before' if key == 'was' else 'now'}: {len(rows)} configurations, mean |error| "
              f"{100 * statistics.mean(errors):.1f}%, max {100 * max(errors):.1f}%, within 10%: "
              f"{sum(e <= 0.10 for e in errors)}", end="")
        if key == "now":
            print(f", goal met (10% or the row's own spread): {sum(r['meets'] for r in rows)}", end="")
    print()


if __name__ == "__main__":
    main(sys.argv[1:])
