#!/usr/bin/env bash
# The local SGD / DiLoCo study of docs/localsgd.md, on the emulated two-host cluster (one rank per host, 300 steps
# of global batch 32, equal tokens). Needs root (dptrain cluster). Each run prints its table; the raw records go to
# $OUT/diloco-*.json. DiLoCo's variants pin the outer lr 0.7 and momentum 0.9, the defaults when these runs were
# made (2026-11-28). About 60 minutes on a 2-core machine; nothing else should run meanwhile (wall times).
set -euo pipefail
OUT=${OUT:-bench_results}
COMMON=(--steps 300 --chunk 25 --eval-every 50 --eval-batches 10)
# 1 Gbit/s, the default GPT (1.84M): two jobs, each with dptrain's DDP as the reference
dptrain bench diloco --rate 1 "${COMMON[@]}" --variants ddp localsgd diloco10-lr0.7-m0.9 diloco50-lr0.7-m0.9 --out "$OUT/diloco-default-1a.json"
dptrain bench diloco --rate 1 "${COMMON[@]}" --variants ddp diloco10-w30-lr0.7-m0.9 diloco50-w30-lr0.7-m0.9 diloco100-w30-lr0.7-m0.9 diloco50-w30-lr0.5-m0.9 \
    --out "$OUT/diloco-default-1b.json"
# 100 Mbit/s, the default GPT: torch's DDP the reference; the variants short of its loss train on (--beyond 2)
dptrain bench diloco --rate 0.1 "${COMMON[@]}" --beyond 2 \
    --variants torch localsgd diloco50-lr0.7-m0.9 diloco100-lr0.7-m0.9 diloco50-int8-lr0.7-m0.9 diloco50-w30-lr0.7-m0.9 --out "$OUT/diloco-default-0.1.json"
# a larger GPT (8 layers, 3.6M), at 1 Gbit/s and at 100 Mbit/s
dptrain bench diloco --rate 1 "${COMMON[@]}" --set gpt.n_layer=8 --variants ddp diloco50-lr0.7-m0.9 diloco50-w30-lr0.7-m0.9 \
    --out "$OUT/diloco-larger-1.json"
dptrain bench diloco --rate 0.1 "${COMMON[@]}" --beyond 2 --set gpt.n_layer=8 \
    --variants torch localsgd diloco50-lr0.7-m0.9 diloco50-int8-lr0.7-m0.9 diloco50-w30-lr0.7-m0.9 --out "$OUT/diloco-larger-0.1.json"
