#!/usr/bin/env bash
# The same ZeRO-1 step at 1 and 25 MiB buckets on the emulated 4 x 1 cluster at 10 Gbit/s, beside less and more
# compute: the calibration's larger probe model (GPT 6 x 320) at its micro-batch 2 and at 4, and the tuned model of
# docs/tune.md's searches (8 x 256) at 4 (docs/tune.md, the fifteenth pass). Each run's median step, compute,
# exposed communication and busy communication (the engine's own count) after the first steps. Needs root.
#   OUT=/tmp/cbc ROUNDS=2 bash docs/repro/comm_beside_compute.sh
set -euo pipefail
OUT=${OUT:-/tmp/comm_beside_compute}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
models=("probe-6x320-micro2 gpt.n_layer=6 gpt.n_embd=320 train.micro_batch_size=2 train.global_batch_size=8"
        "probe-6x320-micro4 gpt.n_layer=6 gpt.n_embd=320 train.micro_batch_size=4 train.global_batch_size=16"
        "tuned-8x256-micro4 gpt.n_layer=8 gpt.n_embd=256 train.micro_batch_size=4 train.global_batch_size=16")
for round in $(seq 1 "$ROUNDS"); do
  for i in "${!models[@]}"; do
    j=$(( (i + round - 1) % ${#models[@]} ))  # each round starts one model further on
    read -r name overrides <<< "${models[$j]}"
    for cap in 1 25; do
      run="$OUT/$name-${cap}MiB-r$round"
      sets=(); for o in $overrides; do sets+=(--set "$o"); done
      OMP_NUM_THREADS=1 dptrain cluster --hosts 4 --bandwidth-gbit 10 -- -m dptrain.run --set 'distributed.strategy="zero1"' \
        --set ddp.bucket_cap_mb=$cap --set train.steps=16 --set checkpoint.every=0 --set log.eval_every=0 \
        "${sets[@]}" --set "run_dir=\"$run\"" > "$run.log" 2>&1
    done
  done
done
python - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
rows = {}
for summary in sorted(Path(sys.argv[1]).glob("*/summary.json")):
    name, cap, _ = summary.parent.name.rsplit("-", 2)
    d = json.loads(summary.read_text())
    rows.setdefault((name, cap), []).append([d[f"median_{k}_ms"] for k in ("step", "compute", "exposed_comm", "comm_busy")])
print(f"{'model':22s} {'bucket':>6s}  runs  {'step':>6s} {'compute':>8s} {'exposed':>8s} {'busy':>6s}  (ms, medians over the runs)")
for (name, cap), runs in sorted(rows.items()):
    med = [statistics.median(r[k] for r in runs) for k in range(4)]
    print(f"{name:22s} {cap:>6s}  {len(runs):4d}  {med[0]:6.0f} {med[1]:8.0f} {med[2]:8.0f} {med[3]:6.0f}")
EOF
