#!/usr/bin/env bash
# Live recovery's study (docs/reliability.md, "Live recovery: the study"). Needs root (network namespaces).
# One thread per worker: four emulated hosts share this machine's cores (docs/notes.md).
set -euo pipefail
OUT=${OUT:-bench_results/live}
export OMP_NUM_THREADS=1
# 4 hosts x 1 worker at 1 Gbit/s, the default GPT, 1,000 committed steps, a worker killed every 60 s: live recovery
# (one torchrun per host) against restarts from a checkpoint every 100 steps, and the same run without failures;
# then the step time without failures, live against not, 2 alternated pairs of 200 steps
python -m dptrain.bench.live --out "$OUT/cluster" --rate 1 --steps 1000 --kill-every 60 \
    --variants live-kills,restart-kills,ddp --overhead-pairs 2 --overhead-steps 200 --set log.every=5
# the live run without failures (the same data order and seeds as live-kills), added to the same results
python -m dptrain.bench.live --out "$OUT/cluster" --rate 1 --steps 1000 --variants live --set log.every=5
# the same kills under `dptrain run --nproc 4` on one machine: a killed worker restarted from the fork server
python -m dptrain.bench.live --out "$OUT/local" --hosts 4 --steps 1000 --kill-every 60 \
    --variants local-live-kills --set log.every=5
# the step time without failures on a smaller GPT (2 blocks of 128), 2 more pairs of 400 steps
python -m dptrain.bench.live --out "$OUT/small" --rate 1 --variants "" --overhead-pairs 2 --overhead-steps 400 \
    --set gpt.n_layer=2 --set gpt.n_embd=128 --set log.every=5
