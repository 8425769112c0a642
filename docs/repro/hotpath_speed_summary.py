"""Issue 48, old (85461f9) against new: dptrain/torch per run (median of per-round ratios, 90% interval), and
new/old per pair, each run's dptrain/torch taken against torch's step in the same run (torch's code is the same in
both, so the machine's drift between runs cancels)."""
import json
import os
import re
import statistics
from pathlib import Path

from dptrain.bench.stats import bootstrap_ci

d = Path(os.environ.get("OUT", "/tmp/hotpath_speed"))


def load(n, v):
    return json.loads((d / f"{n}_{v}.json").read_text())


for prefix, label in (("mlp", "15.9M MLP"), ("sp", "small parameters (800 tensors)")):
    runs = sorted({re.match(rf"({prefix}\d+)_", p.name).group(1) for p in d.glob(f"{prefix}*_new.json")
                   if (d / p.name.replace("_new", "_old")).exists()})
    if not runs:
        continue
    print(f"== {label}: pairs {runs}")
    caps = [k.split("/")[1] for k in load(runs[0], "old")["ratios"] if k.startswith("dptrain_ddp/")]
    for cap in caps:
        key = f"dptrain_ddp/{cap}"
        cells = {v: [load(n, v)["ratios"][key] for n in runs] for v in ("old", "new")}
        for v, rs in cells.items():
            print(f"  {cap:>3} MiB {v}: " + "; ".join(f"{r['median']:.3f} [{r['ci90'][0]:.2f}, {r['ci90'][1]:.2f}]"
                                                      for r in rs) + f"  (median {statistics.median(r['median'] for r in rs):.3f})")
        per_pair = [n["median"] / o["median"] for o, n in zip(cells["old"], cells["new"], strict=True)]
        low, high = bootstrap_ci(per_pair)
        print(f"  {cap:>3} MiB new/old per pair: {', '.join(f'{x:.3f}' for x in per_pair)} "
              f"(median {statistics.median(per_pair):.3f}, 90% interval {low:.3f}-{high:.3f}, "
              f"{sum(x > 1 for x in per_pair)} of {len(per_pair)} above 1)")
