"""Which probes a calibration needs: its probe runs with some left out, the terms refitted, and scored (docs/tune.md).

    python docs/repro/tune_probe_subsets.py EXHAUSTIVE_DIR[:CALIBRATED_DIR] [more]

For each subset of a calibration's probes (all of them; without one of the three probe models; without one of the
nine variants, in every model), the terms are fitted anew to the probes kept (``dptrain.tune.calibrate.refit``:
nothing is measured again; a term no kept probe identifies is held at zero) and the exhaustive search's measured
medians are scored against the new predictions (``tune_rescore.rescore``), with what the tuner would choose: the
best, by the search's medians, of the three it predicts fastest. The seconds a cut saves are the left-out probes'
logged steps and their share of the round's fixed part, from the calibration's own first round.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tune_calibration_length import fixed_s, probe_runs, score
from tune_rescore import refitted

from dptrain.tune.calibrate import probe_stem


def subsets(labels: list[str]) -> list[tuple[str, list[str]]]:
    """(name, labels kept): all; without each model; without each variant in every model."""
    models = sorted({label.split(" ")[0] for label in labels})
    variants = sorted({label.split(" ", 1)[1] for label in labels})
    cuts = [("all", labels)]
    cuts += [(f"no {m}", [x for x in labels if x.split(" ")[0] != m]) for m in models]
    cuts += [(f"no '{v}'", [x for x in labels if x.split(" ", 1)[1] != v]) for v in variants]
    return cuts


def main(argv: list[str]) -> None:
    print("| setting | probes kept | of | seconds saved | mean error | max | within 10% | "
          "best of the first 3 / optimum |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for arg in argv:
        search, _, calibrated = arg.partition(":")
        search, calibrated = Path(search), Path(calibrated or search)
        d = json.loads((calibrated / "calibration.json").read_text())
        runs = {k: v for k, v in probe_runs(calibrated).items() if k[1] == 0}
        per_probe_fixed = fixed_s(runs) / len(runs)
        labels = [p["label"] for p in d["probes"]]
        for name, kept in subsets(labels):
            left = [x for x in labels if x not in kept]
            saved = sum(sum(r["step_ms"] for r in runs[probe_stem(x), 0]) / 1e3 + per_probe_fixed for x in left)
            with tempfile.TemporaryDirectory() as work:
                cut = Path(work) / "cut"
                cut.mkdir()
                (cut / "calibration.json").write_text(json.dumps(dict(d, probes=[p for p in d["probes"]
                                                                                  if p["label"] in kept])))
                (cut / "calibration").symlink_to((calibrated / "calibration").resolve())
                _, rows = refitted(search, cut)  # by the models it probed
            s = score(rows)
            print(f"| {search.name} | {name} | {len(kept)}/{len(labels)} | {saved:.0f} | {s['mean']} | {s['max']} | "
                  f"{s['within']} | {s['pick']} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
