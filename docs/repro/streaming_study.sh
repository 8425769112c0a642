#!/usr/bin/env bash
# Streaming DiLoCo on the emulated two-host cluster at 100 Mbit/s (docs/localsgd.md, "Streaming DiLoCo on a slow
# link"): torch's DDP against Streaming DiLoCo (H = 30, 2 fragments, 1 step of overlap, E3M0 pseudo-gradients,
# outer momentum 0.7), one rank per host, the default GPT, 1,500 steps of global batch 32 at equal tokens; a variant
# short of torch's final loss trains on to step 3,000 at the schedule's last rate (--beyond 2). Needs root
# (dptrain cluster). About 35 minutes on a 2-core machine; nothing else should run meanwhile (wall times).
set -euo pipefail
# HOSTS=4: the same on 4 emulated hosts (global batch 32, 8 a host; about 45 minutes).
OUT=${OUT:-bench_results}
HOSTS=${HOSTS:-2}
SUFFIX=$([ "$HOSTS" = 2 ] || echo "-${HOSTS}hosts")
dptrain bench diloco --hosts "$HOSTS" --rate 0.1 --steps 1500 --chunk 50 --eval-every 100 --eval-batches 10 --beyond 2 \
    --variants torch diloco30-f2-o1-e3m0-m0.7 --out "$OUT/streaming-default-0.1$SUFFIX.json"
