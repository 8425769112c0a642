#!/usr/bin/env bash
# The local SGD / DiLoCo study of docs/localsgd.md: two link rates, two model sizes, equal tokens (300 steps).
# Needs root (dptrain cluster). Each run prints its table; the raw records go to $OUT/diloco-*.json.
set -euo pipefail
OUT=${OUT:-bench_results}
COMMON=(--steps 300 --chunk 25 --eval-every 25 --eval-batches 10)
ALL=(torch ddp localsgd diloco10 diloco50 diloco100 diloco50-int8)
LARGER=(--set gpt.n_layer=8)   # 3.6M parameters against the default's 1.8M
dptrain bench diloco --rate 0.1 "${COMMON[@]}" --beyond 2 --variants "${ALL[@]}" diloco50-w30 --out "$OUT/diloco-default-0.1.json"
dptrain bench diloco --rate 1 "${COMMON[@]}" --variants "${ALL[@]}" diloco50-w30 --out "$OUT/diloco-default-1.json"
dptrain bench diloco --rate 0.1 "${COMMON[@]}" --beyond 2 --variants "${ALL[@]}" "${LARGER[@]}" --out "$OUT/diloco-larger-0.1.json"
dptrain bench diloco --rate 1 "${COMMON[@]}" --variants "${ALL[@]}" "${LARGER[@]}" --out "$OUT/diloco-larger-1.json"
