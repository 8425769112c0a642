#!/usr/bin/env bash
# Live recovery for DiLoCo: the study (docs/reliability.md, "Live recovery for DiLoCo: the study"). Needs root.
# 4 emulated hosts x 1 worker, every link 100 Mbit/s, the default GPT, 1,000 steps of DiLoCo (H = 30, int8
# pseudo-gradients), a worker SIGKILLed every 60 s: live recovery (a round per meeting) against restarts from a
# checkpoint every 100 steps, and the live run without failures. One thread per worker.
set -euo pipefail
OUT=${OUT:-bench_results/live_diloco}
export OMP_NUM_THREADS=1
# the outer lr and momentum pinned at 0.7 and 0.9, the defaults when the study was made (2026-12-05)
DILOCO=(--set distributed.strategy=diloco --set diloco.period=30 --set diloco.compression=int8 --set log.every=5
        --set diloco.outer_lr=0.7 --set diloco.outer_momentum=0.9)
python -m dptrain.bench.live --out "$OUT" --rate 0.1 --steps 1000 --kill-every 60 \
    --variants live-kills,restart-kills,live "${DILOCO[@]}"
# A user's own loop on prepare() and dptrain.Live (dptrain.bench.live_loop), the default GPT at 1 Gbit/s, with the
# same kills, and without them (docs/reliability.md, "Live recovery in your own loop: the study")
python -m dptrain.bench.live --out "${OUT_LOOP:-bench_results/live_loop}" --rate 1 --steps 1000 --kill-every 60 \
    --variants loop-kills,loop
