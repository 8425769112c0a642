"""The tables of docs/tune.md from the study's results (docs/repro/tune_study.sh).

    python docs/repro/tune_summary.py bench_results/tune
    python docs/repro/tune_summary.py TUNER_DIR:SEARCH_DIR ...     # tuner runs against searches of other directories

Fidelity: every measured candidate of every exhaustive setting, predicted / measured (the median of its runs), its
runs' spread ((max - min) / median) and whether it meets the goal: within 10% of the median, or within its own
spread where that exceeds 10%.
Tuner: each tuner run against the exhaustive search of the same setting (same space).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(d: Path) -> dict:
    return json.loads((d / "tune.json").read_text())


def spread(r: dict) -> float | None:
    """The row's runs' spread as dptrain tune wrote it (``Row.spread``); None for one run or a record without it."""
    return r.get("spread")


def meets(r: dict) -> bool:
    """Within 10% of the measured median, or within the configuration's own repeat spread where that is larger."""
    return abs(r["predicted_s"] / r["measured_s"] - 1) <= max(0.10, spread(r) or 0.0)


def fidelity(root: Path) -> None:
    print("| setting | candidate | predicted ms | measured ms (median) | runs | spread | predicted / measured | "
          "goal |\n|---|---|---:|---:|---:|---:|---:|---|")
    errors, settings, met = [], [], 0
    for d in sorted(root.glob("*")):
        if not (d / "tune.json").exists() or "tuner" in d.name:
            continue
        t = load(d)
        rows = [r for r in t["rows"] if r["measured_s"] and r["predicted_s"]]
        for r in rows:
            ratio = r["predicted_s"] / r["measured_s"]
            errors.append(abs(ratio - 1))
            met += meets(r)
            sp = spread(r)
            print(f"| {d.name} | {r['candidate']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
                  f"{len(r.get('measured_runs_s') or [])} | {'-' if sp is None else f'{100 * sp:.1f}%'} | "
                  f"{ratio:.3f} | {'met' if meets(r) else 'missed'} |")
        top = rows[0]  # the predicted order
        best = min(rows, key=lambda r: r["measured_s"])
        spreads = [s for s in map(spread, rows) if s is not None]
        settings.append((d.name, top["candidate"], best["candidate"], top["measured_s"] / best["measured_s"],
                         max(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows),
                         statistics.mean(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows), len(rows),
                         statistics.median(spreads) if spreads else None, sum(map(meets, rows))))
    print(f"\n{len(errors)} configurations: mean |error| {100 * statistics.mean(errors):.1f}%, max "
          f"{100 * max(errors):.1f}%, within 10%: {sum(e <= 0.10 for e in errors)}, goal met (10% or the row's own "
          f"spread): {met}\n")
    print("| setting | configurations | mean abs error | max abs error | median spread | goal met | predicted best | "
          "measured best | predicted best's step / best's |\n|---|---:|---:|---:|---:|---:|---|---|---:|")
    for name, top, best, ratio, worst, mean, n, sp, ok in settings:
        print(f"| {name} | {n} | {100 * mean:.1f}% | {100 * worst:.1f}% | "
              f"{'-' if sp is None else f'{100 * sp:.1f}%'} | {ok} of {n} | {top} | {best} | {ratio:.3f} |")


def tuner(root: Path) -> None:
    print("\n| setting | tuner's choice | its step in the exhaustive search, ms | exhaustive optimum | its step, ms | "
          "choice / optimum | trials (runs) | tuner wall s (with calibration) | exhaustive wall s (with calibration) | "
          "wall ratio (both with the calibration) |\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for d in sorted(root.glob("*-tuner")):
        ex = root / d.name.replace("-tuner", "-exhaustive")
        if not (d / "tune.json").exists() or not (ex / "tune.json").exists():
            continue
        t, e = load(d), load(ex)
        measured = {r["candidate"]: r["measured_s"] for r in e["rows"] if r["measured_s"]}
        best = min(measured, key=measured.get)
        choice = t["best"]
        tw = t["seconds"]["profile"] + t["seconds"]["search"]
        ew = e["seconds"]["profile"] + e["seconds"]["search"]
        cal = e["seconds"]["calibration"]
        runs = sum(len(r.get("measured_runs_s") or []) for r in t["rows"])
        print(f"| {d.name.replace('-tuner', '')} | {choice} | {measured[choice] * 1e3:.1f} | {best} | "
              f"{measured[best] * 1e3:.1f} | {measured[choice] / measured[best]:.3f} | {t['trials']} ({runs}) | "
              f"{tw:.0f} ({tw + cal:.0f}) | {ew:.0f} ({ew + cal:.0f}) | {tw / ew:.3f} ({(tw + cal) / (ew + cal):.3f}) |")


def against(pairs: list[str]) -> None:
    """Each tuner run (its calibration counted) against a search measured elsewhere: the time the tuner spent and
    the step its choice took in the search, over the search's best."""
    print("| tuner <- search | calibration s | trials (runs) s | tuner s | search's trials s | tuner / search | choice "
          "| / optimum |\n|---|---:|---:|---:|---:|---:|---|---:|")
    for pair in pairs:
        d, ex = (Path(p) for p in pair.split(":"))
        t, e = load(d), load(ex)
        measured = {r["candidate"]: r["measured_s"] for r in e["rows"] if r["measured_s"]}
        cal, trials = t["seconds"]["calibration"], t["seconds"]["profile"] + t["seconds"]["search"]
        searched = e["seconds"]["profile"] + e["seconds"]["search"]
        runs = sum(len(r.get("measured_runs_s") or []) for r in t["rows"])
        print(f"| {d.parent.name}/{d.name} <- {ex.parent.name}/{ex.name} | {cal:.1f} | {trials:.1f} ({runs}) | "
              f"{cal + trials:.1f} | {searched:.1f} | {(cal + trials) / searched:.3f} | {t['best']} | "
              f"{measured[t['best']] / min(measured.values()):.3f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and ":" in sys.argv[1]:
        against(sys.argv[1:])
        sys.exit(0)
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_results/tune")
    fidelity(root)
    tuner(root)
