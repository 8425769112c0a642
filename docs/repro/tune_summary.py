"""The tables of docs/tune.md from the study's results (docs/repro/tune_study.sh).

    python docs/repro/tune_summary.py bench_results/tune

Fidelity: every measured candidate of every exhaustive setting, predicted / measured.
Tuner: each tuner run against the exhaustive search of the same setting (same space).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(d: Path) -> dict:
    return json.loads((d / "tune.json").read_text())


def fidelity(root: Path) -> None:
    print("| setting | candidate | predicted ms | measured ms | predicted / measured |\n|---|---|---:|---:|---:|")
    errors, settings = [], []
    for d in sorted(root.glob("*")):
        if not (d / "tune.json").exists() or "tuner" in d.name:
            continue
        t = load(d)
        rows = [r for r in t["rows"] if r["measured_s"] and r["predicted_s"]]
        for r in rows:
            ratio = r["predicted_s"] / r["measured_s"]
            errors.append(abs(ratio - 1))
            print(f"| {d.name} | {r['candidate']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
                  f"{ratio:.3f} |")
        top = rows[0]  # the predicted order
        best = min(rows, key=lambda r: r["measured_s"])
        settings.append((d.name, top["candidate"], best["candidate"], top["measured_s"] / best["measured_s"],
                         max(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows),
                         statistics.mean(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows), len(rows)))
    print(f"\n{len(errors)} configurations: mean |error| {100 * statistics.mean(errors):.1f}%, max "
          f"{100 * max(errors):.1f}%, within 10%: {sum(e <= 0.10 for e in errors)}\n")
    print("| setting | configurations | mean abs error | max abs error | predicted best | measured best | "
          "predicted best's step / best's |\n|---|---:|---:|---:|---|---|---:|")
    for name, top, best, ratio, worst, mean, n in settings:
        print(f"| {name} | {n} | {100 * mean:.1f}% | {100 * worst:.1f}% | {top} | {best} | {ratio:.3f} |")


def tuner(root: Path) -> None:
    print("\n| setting | tuner's choice | its step in the exhaustive search, ms | exhaustive optimum | its step, ms | "
          "choice / optimum | trials | tuner wall s (with calibration) | exhaustive wall s (with calibration) | "
          "wall ratio |\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
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
        print(f"| {d.name.replace('-tuner', '')} | {choice} | {measured[choice] * 1e3:.1f} | {best} | "
              f"{measured[best] * 1e3:.1f} | {measured[choice] / measured[best]:.3f} | {t['trials']} | "
              f"{tw:.0f} ({tw + cal:.0f}) | {ew:.0f} ({ew + cal:.0f}) | {tw / ew:.3f} |")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_results/tune")
    fidelity(root)
    tuner(root)
