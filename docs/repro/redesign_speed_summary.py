"""Old (pre-redesign f909203) vs new (main): dptrain/torch per run, and new/old of dptrain's own step time
normalised by torch's in the same run (torch's code is the same in both, so it cancels the machine's drift)."""
import json
import os
import re
import statistics
from pathlib import Path

d = Path(os.environ.get("OUT", "/tmp/redesign_speed"))
def load(n, v): return json.loads((d / f"{n}_{v}.json").read_text())
for prefix in ("mlp", "sp"):
    runs = sorted({re.match(rf"({prefix}\d+)_", p.name).group(1) for p in d.glob(f"{prefix}*_new.json") if (d / p.name.replace("_new", "_old")).exists()})
    if not runs: continue
    print(f"== {prefix}: runs {runs}")
    caps = [k.split("/")[1] for k in load(runs[0], "old")["median_step_s"] if k.startswith("dptrain_ddp/")]
    for cap in caps:
        old_r = [load(n, "old")["median_step_s"][f"dptrain_ddp/{cap}"] / load(n, "old")["median_step_s"][f"torch_ddp/{cap}"] for n in runs]
        new_r = [load(n, "new")["median_step_s"][f"dptrain_ddp/{cap}"] / load(n, "new")["median_step_s"][f"torch_ddp/{cap}"] for n in runs]
        print(f"cap {cap:>4} MiB: dptrain/torch old {', '.join(f'{x:.3f}' for x in old_r)} (median {statistics.median(old_r):.3f}); "
              f"new {', '.join(f'{x:.3f}' for x in new_r)} (median {statistics.median(new_r):.3f}); new/old {statistics.median(new_r)/statistics.median(old_r):.3f}")
runs = sorted({re.match(r"(zero\d+)_", p.name).group(1) for p in d.glob("zero*_new.json") if (d / p.name.replace("_new", "_old")).exists()})
if runs:
    print(f"== zero: runs {runs}")
    for v in ("dptrain_zero1", "dptrain_zero2", "dptrain_zero3"):
        r = [load(n, "new")["median_step_s"][v] / load(n, "old")["median_step_s"][v] for n in runs]
        print(f"{v}: new/old per run {', '.join(f'{x:.3f}' for x in r)} (median {statistics.median(r):.3f}); "
              "old ms " + ", ".join("%.1f" % (1e3 * load(n, "old")["median_step_s"][v]) for n in runs))
