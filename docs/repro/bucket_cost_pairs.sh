#!/bin/bash
# dptrain bench bucket-cost, old against new, ABBA (old, new, new, old) PAIRS times; then the medians over runs of
# each run's dptrain/torch ratio, its reducer/torch ratio, and the profiled groups (ms per step, rank 0). In a venv:
#   git worktree add /tmp/oldA e76b37e && OLD=/tmp/oldA PAIRS=3 OUT=/tmp/bcA bash docs/repro/bucket_cost_pairs.sh
set -eu
new=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=${OUT:-/tmp/bucket_cost_pairs}; mkdir -p "$out"
cd /tmp
for i in $(seq "${PAIRS:-3}"); do
  for v in old new new old; do
    if [ "$v" = old ]; then src=$OLD/src; else src=$new/src; fi
    n=$(ls "$out" | grep -c "^${v}_.*\.json$" || true)
    PYTHONPATH=$src python -m dptrain.cli bench bucket-cost --world-size "${WORLD:-2}" --rounds 12 \
      --out "$out/${v}_$n.json" > "$out/${v}_$n.log" 2>&1
  done
done
python - "$out" <<'PY'
import glob, json, statistics as st, sys
out = sys.argv[1]
for cap in ("1.0", "4.0", "25.0"):
    for v in ("old", "new"):
        runs = [json.load(open(f))["caps"][cap] for f in sorted(glob.glob(f"{out}/{v}_*.json"))]
        ratio = st.median(r["dptrain_over_torch"]["median"] for r in runs)
        reducer = st.median(r["reducer_over_torchs"]["median"] for r in runs)
        groups = {var: " ".join(f"{k} {st.median(r['profile_ms_per_step'][var][k] for r in runs):.2f}"
                                for k in ("copies", "collectives", "hooks", "rest")) for var in ("torch", "dptrain")}
        print(f"{cap:>4} MiB {v}: {len(runs)} runs, dptrain/torch {ratio:.3f}, reducer/torch {reducer:.3f}; "
              f"per run {' '.join(format(r['dptrain_over_torch']['median'], '.3f') for r in runs)}; "
              f"torch: {groups['torch']}; dptrain: {groups['dptrain']}")
PY
