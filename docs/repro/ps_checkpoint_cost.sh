#!/bin/bash
# What async PS cuts cost (docs/async.md, "Checkpoints and restarts"): the default task (1.84M parameters), 2 workers
# and a server, 40 steps, a cut every 5 steps against only the last one, interleaved over R rounds (which goes first
# alternates). Prints each run's wall time, median samples/s and its checkpoints' sizes.
#     bash docs/repro/ps_checkpoint_cost.sh 3
set -eu
rounds=${1:-3}
out=$(mktemp -d)
for r in $(seq 1 "$rounds"); do
  order="0 5"; [ $((r % 2)) -eq 0 ] && order="5 0"  # alternate which goes first
  for every in $order; do
    dptrain run --nproc 3 --set distributed.strategy=ps --set ps.mode=async --set train.steps=40 \
      --set train.global_batch_size=32 --set checkpoint.every=$every --set log.every=5 --set log.eval_every=0 \
      --set log.progress=lines --set log.plots=false --run-dir "$out/e$every-r$r" > "$out/e$every-r$r.log" 2>&1
    python - "$out/e$every-r$r/summary.json" "$every" "$r" <<'PY'
import json, sys
s, every, r = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
sizes = {k: f"{v / 2**20:.1f} MiB" for k, v in s["files"].items() if k.startswith("checkpoints/")}
print(f"every {every}, round {r}: wall {s['wall_s']:.1f} s, median {s['median_samples_per_s']:.1f} samples/s, "
      f"{len(s['ps']['checkpoints'])} cut(s) published; kept {sizes}")
PY
  done
done
rm -rf "$out"
