"""The fourteenth pass's 1 MiB probe runs predicted out of sample: each tune25 calibration refitted without them.

    PROBE_SMALL=0.25 PYTHONPATH=/tmp/studytree25/src python docs/repro/tune_probe_small_oos.py   # (docs/tune.md)
"""

import json
import tempfile
from pathlib import Path

from dptrain.planner.simulate import Overheads
from dptrain.tune.calibrate import refit

R = Path("bench_results/tune25")
for d in ("space-4x1-10-tuner", "space-2x2-10-tuner", "space-4x1-10-exhaustive", "space-2x2-10-exhaustive"):
    raw = json.loads((R / d / "calibration.json").read_text())
    with tempfile.TemporaryDirectory() as w:
        cal = refit(R / d / "calibration.json", Path(w), log=lambda s: None)  # PROBE_SMALL=0.25: the 1 MiB runs left out
    o = cal.overheads
    names = Overheads.names()
    # the 1 MiB probe runs, out of sample: their timelines and features come from the full calibration's file
    out = []
    for p in raw["probes"]:
        if " 1MiB" in p["label"]:
            pred = p["timeline_s"] + sum(getattr(o, n) * f for n, f in zip(names, p["features"], strict=True))
            out.append(f"{p['label']} {pred / p['measured_s']:.3f}")
    print(d, "| 1 MiB probes, out of sample:", "; ".join(out))
