#!/usr/bin/env bash
# dptrain tune's model of the strategies that meet every few steps (docs/localsgd.md, "dptrain tune and these
# strategies"): on the emulated cluster, 2 hosts x 1 rank at 0.1 Gbit/s, the default GPT, global batch 32, the
# simulator's predicted step of local SGD (H = 8, fp32), DiLoCo (H = 30, fp32) and Streaming DiLoCo (H = 30,
# 2 fragments, 1 step of overlap, E3M0) against each one's measured mean step over whole rounds of its sync points,
# beside DDP's. Needs root (dptrain cluster). About 20 minutes on a 2-core machine (the calibration is most of it).
#   OUT=bench_results/tune_periodic bash docs/repro/tune_periodic.sh
set -euo pipefail
OUT=${OUT:-bench_results/tune_periodic}
mkdir -p "$OUT"
COMMON=(--cluster 2x1 --bandwidth-gbit 0.1 --global-batch 32 --micro-batches 16,8 --buckets 25
        --steps 12 --warmup 4 --trial-timeout 600 --exhaustive)
run() { local name=$1; shift; [ -e "$OUT/$name" ] && { echo "skip $name (exists)"; return; }
        /usr/bin/time -f "$name wall %e s" dptrain tune --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 || echo "$name failed: see $OUT/$name.log"; tail -n 3 "$OUT/$name.log"; }
run whole "${COMMON[@]}" --strategies ddp,localsgd,diloco --set diloco.period=30
run streaming "${COMMON[@]}" --strategies ddp,diloco --set diloco.period=30 --set diloco.fragments=2 \
    --set diloco.overlap_steps=1 --set diloco.compression=e3m0 --calibration "$OUT/whole/calibration.json"
