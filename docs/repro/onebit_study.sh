#!/usr/bin/env bash
# 1-bit Adam's freeze (docs/compression.md, "The study"): AdamW, 1-bit Adam freezing v when its rule finds it
# settled (the default), and frozen at the LR warm-up's end (step 30, the default before issue 46), at 150, 300
# and 1,000 steps on the default GPT (1.84M) and a 2-layer, width-80 GPT. The raw records: $OUT/onebit-*.json.
set -euo pipefail
OUT=${OUT:-bench_results}
VARIANTS=(none "onebit adam" "onebit adam freeze 30")
SMALL=(--set gpt.n_layer=2 --set gpt.n_embd=80)
for steps in 150 300 1000; do
    dptrain bench compression --steps "$steps" --variants "${VARIANTS[@]}" "${SMALL[@]}" --out "$OUT/onebit-2x80-$steps.json"
    dptrain bench compression --steps "$steps" --variants "${VARIANTS[@]}" --out "$OUT/onebit-default-$steps.json"
done
