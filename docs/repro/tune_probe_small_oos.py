"""The fourteenth pass's 1 MiB probe runs predicted out of sample: each tune25 calibration refitted without them.

    PROBE_SMALL=0.25 PYTHONPATH=/tmp/studytree25/src python docs/repro/tune_probe_small_oos.py   # (docs/tune.md)
"""

import json
import tempfile
from dataclasses import replace
from pathlib import Path

from dptrain.planner.calibration import ProbeRun
from dptrain.tune.calibrate import refit

R = Path("bench_results/tune25")
for d in ("space-4x1-10-tuner", "space-2x2-10-tuner", "space-4x1-10-exhaustive", "space-2x2-10-exhaustive"):
    raw = json.loads((R / d / "calibration.json").read_text())
    with tempfile.TemporaryDirectory() as w:
        cal = refit(R / d / "calibration.json", Path(w), log=lambda s: None)  # PROBE_SMALL=0.25: the 1 MiB runs left out
    # the 1 MiB probe runs, out of sample: their timelines and features as the full calibration's file holds them
    held_out = [ProbeRun(p["label"], p["measured_s"], p["timeline_s"], tuple(p["features"]))
                for p in raw["probes"] if " 1MiB" in p["label"]]
    rows = replace(cal, probes=held_out).residuals()
    print(d, "| 1 MiB probes, out of sample:", "; ".join(f"{r['label']} {r['ratio']:.3f}" for r in rows))
