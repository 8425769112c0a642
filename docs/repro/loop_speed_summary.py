"""The summary of docs/repro/loop_speed.sh: per strategy and task, new/old of the run's wall time per step (the whole
loop: hooks, gate, data) and of the median step (forward, backward, optimizer), the median of the per-pair ratios with
the pairs' range. Usage: OUT=/tmp/loop58 python docs/repro/loop_speed_summary.py"""

import json
import os
import re
import statistics
from pathlib import Path

out = Path(os.environ.get("OUT", "/tmp/loop_speed"))
pairs: dict[tuple[str, str], list[tuple[float, float]]] = {}
for new in sorted(out.glob("*_new.json")):
    old = new.with_name(new.name.replace("_new.json", "_old.json"))
    if not old.exists():
        continue
    task, strategy = re.match(r"(cls|gpt)_(\w+?)_\d+_new", new.stem).groups()
    a, b = json.loads(old.read_text()), json.loads(new.read_text())
    wall = (b["wall_s"] / b["steps"]) / (a["wall_s"] / a["steps"])
    step = b["median_step_ms"] / a["median_step_ms"]
    pairs.setdefault((task, strategy), []).append((wall, step))
print("| task | strategy | pairs | wall per step, new/old (range) | median step, new/old (range) |")
print("|---|---|---|---|---|")
for (task, strategy), rows in sorted(pairs.items()):
    walls, steps = [r[0] for r in rows], [r[1] for r in rows]
    print(f"| {task} | {strategy} | {len(rows)} | {statistics.median(walls):.3f} ({min(walls):.3f}-{max(walls):.3f}) | "
          f"{statistics.median(steps):.3f} ({min(steps):.3f}-{max(steps):.3f}) |")
