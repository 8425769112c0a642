#!/usr/bin/env bash
# The study of docs/tune.md: the calibrated simulator's fidelity on the emulated cluster, and the tuner against
# the exhaustive search on three settings. Needs root (dptrain cluster). About an hour on a 2-core machine.
#   OUT=bench_results/tune bash docs/repro/tune_study.sh [SETTING ...]     (SETTING: fid-2x1-1 fid-2x1-100 local cluster-1 cluster-100
#   space-HxP-RATE for HxP in 4x1 2x2 and RATE in 0.1 1 10)
# Each setting's directory holds the calibration, every trial's config and run, tune.json and tune.md. The exhaustive
# searches measure every candidate ROUNDS times (default 3, interleaved: the median and its spread); the tuner runs
# with its defaults (one run each, then the stopping rule, at most 3).
# EXHAUSTIVE=0 runs the tuners alone, each measuring a calibration of its own (its time counted), to score an earlier
# study's exhaustive searches against (docs/repro/tune_rescore.py), e.g.
#   OUT=bench_results/tune3 EXHAUSTIVE=0 bash docs/repro/tune_study.sh local space-4x1-1
set -euo pipefail
OUT=${OUT:-bench_results/tune}
ROUNDS=${ROUNDS:-3}
EXHAUSTIVE=${EXHAUSTIVE:-1}
mkdir -p "$OUT"
LARGER=(--set gpt.n_layer=8 --set gpt.n_embd=256)
COMMON=(--buckets 1,4,25 --strategies ddp,zero1,zero2,zero3 --steps 12 --warmup 4 --trial-timeout 300)
run() { local name=$1; shift; [ -e "$OUT/$name" ] && { echo "skip $name (exists)"; return; }
        if [ "$EXHAUSTIVE" = 0 ]; then  # tuners only, each with a calibration of its own
          case "$name" in *-exhaustive|fid-*) echo "skip $name (EXHAUSTIVE=0)"; return;; esac
          local kept=() skip=0; for a in "$@"; do
            if [ $skip = 1 ]; then skip=0; elif [ "$a" = --calibration ]; then skip=1; else kept+=("$a"); fi; done
          set -- "${kept[@]}"; fi
        /usr/bin/time -f "$name wall %e s" dptrain tune --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 || echo "$name failed: see $OUT/$name.log"; tail -n 3 "$OUT/$name.log"; }
want() { [ -z "${SETTINGS}" ] || [[ " ${SETTINGS} " == *" $1 "* ]]; }
SETTINGS="$*"
# fidelity: 2 hosts x 1 rank, the default GPT, 16 samples per rank, every ddp bucket, zero1-2 bucket and zero3
for rate in 1 100; do
  want "fid-2x1-$rate" && run "fid-2x1-$rate" --cluster 2x1 --bandwidth-gbit $rate --global-batch 32 \
    --micro-batches 16 "${COMMON[@]}" --exhaustive --rounds $ROUNDS
done
# tuner vs exhaustive 1: the default GPT on 2 local ranks, global batch 32, the whole space
if want local; then
  run local-exhaustive --nproc 2 --global-batch 32 "${COMMON[@]}" --exhaustive --rounds $ROUNDS
  run local-tuner --nproc 2 --global-batch 32 "${COMMON[@]}" --calibration "$OUT/local-exhaustive/calibration.json"
fi
# tuner vs exhaustive 2 and 3 (also fidelity at 2 x 2): a larger GPT on the emulated 2x2 cluster at 1 and 100 Gbit/s
for rate in 1 100; do
  if want "cluster-$rate"; then
    run "cluster-$rate-exhaustive" --cluster 2x2 --bandwidth-gbit $rate "${LARGER[@]}" --global-batch 16 \
      --micro-batches 4,2 --buckets 1,25 --strategies ddp,zero1,zero2,zero3 --steps 12 --warmup 4 --trial-timeout 300 --exhaustive --rounds $ROUNDS
    run "cluster-$rate-tuner" --cluster 2x2 --bandwidth-gbit $rate "${LARGER[@]}" --global-batch 16 \
      --micro-batches 4,2 --buckets 1,25 --strategies ddp,zero1,zero2,zero3 --steps 12 --warmup 4 --trial-timeout 300 \
      --calibration "$OUT/cluster-$rate-exhaustive/calibration.json"
  fi
done
# tuner vs exhaustive on the whole space of the emulated 4-host cluster: 4 x 1 and 2 x 2 at 0.1, 1 and 10 Gbit/s, the
# larger GPT at global batch 16 (micro-batch 4 or 2: accumulation 1 or 2), buckets 1 and 25 MiB, DDP with and without
# the bf16 codec, ZeRO-1/2 plain and hybrid over 2 ranks, ZeRO-3 plain and hybrid (28 candidates)
SPACE=(--global-batch 16 --micro-batches 4,2 --buckets 1,25 --codecs none,bf16 --strategies ddp,zero1,zero2,zero3
       --steps 12 --warmup 4 --trial-timeout 300)
for shape in 4x1 2x2; do
  for rate in 0.1 1 10; do
    if want "space-$shape-$rate"; then
      run "space-$shape-$rate-exhaustive" --cluster $shape --bandwidth-gbit $rate "${LARGER[@]}" "${SPACE[@]}" \
        --exhaustive --rounds $ROUNDS
      run "space-$shape-$rate-tuner" --cluster $shape --bandwidth-gbit $rate "${LARGER[@]}" "${SPACE[@]}" \
        --calibration "$OUT/space-$shape-$rate-exhaustive/calibration.json"
    fi
  done
done
