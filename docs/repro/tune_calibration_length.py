"""How long a calibration must run: its probes' own runs cut shorter, refitted, and scored (docs/tune.md).

    python docs/repro/tune_calibration_length.py EXHAUSTIVE_DIR[:CALIBRATED_DIR] [more]

``CALIBRATED_DIR`` (default ``EXHAUSTIVE_DIR``) is a tune directory whose calibration kept its probe runs
(``calibration/probes/<probe>-r<round>/run/metrics.jsonl``). For each way of cutting them short (the rounds kept,
the steps each probe runs, the warm-up steps left out), every probe's step time is taken again from the same runs
as the calibration takes it (the median of each run's steps after the warm-up, the median of the rounds), the
twelve terms are fitted anew to them (``dptrain.tune.calibrate.refit``: nothing is measured again), and the
exhaustive search's measured medians are scored against the new predictions (``tune_rescore.rescore``), with what
the tuner would choose: the best, by the search's medians, of the three it predicts fastest. The time
each cut would take is the probes' logged steps it keeps plus each probe run's fixed part (from its config being
written to the end of its last step, less its steps), as measured; the links and compute profiles, measured once
whatever the cut, are left out of both.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from tune_rescore import refitted

from dptrain.pages.plots import read_metrics
from dptrain.tune.calibrate import probe_stem

# (the rounds kept, steps, warm-up): the calibration as run, then one round (either), then fewer steps
TRIALS = 3  # dptrain tune's --trials: the candidates it measures, the fastest predicted first
CUTS = [((0, 1), 12, 4), ((0,), 12, 4), ((1,), 12, 4), ((0, 1), 8, 3), ((0,), 8, 3), ((1,), 8, 3), ((0, 1), 6, 2),
        ((0,), 6, 2), ((1,), 6, 2), ((0,), 5, 2), ((1,), 5, 2), ((0,), 4, 1), ((1,), 4, 1)]


def probe_runs(calibrated: Path) -> dict[tuple[str, int], list[dict]]:
    """Every probe run's train records, by (the probe's directory stem, round)."""
    runs = {}
    for d in (calibrated / "calibration" / "probes").iterdir():
        if not (d / "run" / "metrics.jsonl").is_file():  # a probe job's plan beside its runs
            continue
        stem, _, r = d.name.rpartition("-r")
        records, _ = read_metrics(d / "run" / "metrics.jsonl")
        runs[stem, int(r)] = [x for x in records if x.get("kind") == "train"]
    return runs


def fixed_s(runs: dict[tuple[str, int], list[dict]]) -> float:
    """The probe runs' time outside their logged steps: in each round (one job), from the first step's start to the
    last step's end, less the steps, over the rounds; plus nothing for the job's start, which any cut pays."""
    total = 0.0
    for r in sorted({r for _, r in runs}):
        records = [x for (_, rr), xs in runs.items() if rr == r for x in xs]
        start = min(x["time"] - x["step_ms"] / 1e3 for x in records)
        total += max(x["time"] for x in records) - start - sum(x["step_ms"] for x in records) / 1e3
    return total


def cut_calibration(calibrated: Path, runs: dict, rounds: tuple[int, ...], steps: int, warmup: int, out: Path) -> float:
    """Write ``out``/calibration.json with each probe's step time from the cut; the seconds of steps it keeps."""
    d = json.loads((calibrated / "calibration.json").read_text())
    kept = 0.0
    for p in d["probes"]:
        stem = probe_stem(p["label"])
        medians = []
        for r in rounds:
            records = runs[stem, r]
            medians.append(statistics.median(x["step_ms"] / 1e3 for x in records if warmup < x["step"] <= steps))
            kept += sum(x["step_ms"] / 1e3 for x in records if x["step"] <= steps)
        p["measured_s"] = statistics.median(medians)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(d))
    (out / "calibration").symlink_to((calibrated / "calibration").resolve())
    return kept


def main(argv: list[str]) -> None:
    print("| setting | rounds kept | steps (warm-up) | probes' steps s | + fixed s | mean error | max | within 10% | "
          "goal met | best of the first 3 / optimum |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arg in argv:
        search, _, calibrated = arg.partition(":")
        search, calibrated = Path(search), Path(calibrated or search)
        runs = probe_runs(calibrated)
        fixed_per_round = fixed_s(runs) / len({r for _, r in runs})
        for rounds, steps, warmup in CUTS:
            with tempfile.TemporaryDirectory() as work:
                kept = cut_calibration(calibrated, runs, rounds, steps, warmup, Path(work) / "cut")
                _, rows = refitted(search, Path(work) / "cut")
            s = score(rows)
            print(f"| {search.name} | {','.join(map(str, rounds))} | {steps} ({warmup}) | {kept:.0f} | "
                  f"{fixed_per_round * len(rounds):.0f} | {s['mean']} | {s['max']} | {s['within']} | {s['met']} | "
                  f"{s['pick']} |")


def score(rows: list[dict]) -> dict[str, str]:
    """A refitted calibration's scores on a search (``tune_rescore.rescore``'s rows), as the tables print them: the
    mean and largest error, the rows within 10%, the rows meeting the goal, and what the tuner would choose (the
    best, by the search's medians, of the ``TRIALS`` it predicts fastest) over the optimum."""
    errors = [abs(r["now"] - 1) for r in rows]
    first = sorted(rows, key=lambda r: r["now"] * r["measured_s"])[:TRIALS]  # the tuner's trials
    pick = min(r["measured_s"] for r in first) / min(r["measured_s"] for r in rows)
    return {"mean": f"{100 * statistics.mean(errors):.1f}%", "max": f"{100 * max(errors):.1f}%",
            "within": f"{sum(e <= 0.10 for e in errors)}/{len(rows)}", "met": str(sum(r["meets"] for r in rows)),
            "pick": f"{pick:.3f}"}


if __name__ == "__main__":
    main(sys.argv[1:])
