#!/usr/bin/env bash
# Live recovery for hybrid ZeRO-3: the study (docs/reliability.md, "Live recovery for hybrid ZeRO: the study"). Needs
# root. 4 emulated hosts x 1 worker, every link 1 Gbit/s, the default GPT, 1,000 steps of ZeRO-3 sharded over groups
# of 2 workers (2 x 2: two replicas, each sharded over two hosts), a worker SIGKILLed every 60 s (the other worker of
# its group ends with it, and both are healed as a group): live recovery against restarts from a checkpoint every
# 100 steps, and the live run without failures. One thread per worker.
set -euo pipefail
OUT=${OUT:-bench_results/live_hybrid}
export OMP_NUM_THREADS=1
python -m dptrain.bench.live --out "$OUT" --rate 1 --steps 1000 --kill-every 60 \
    --variants live-kills,restart-kills,live \
    --set distributed.strategy=zero3 --set zero.shard_size=2 --set log.every=5
