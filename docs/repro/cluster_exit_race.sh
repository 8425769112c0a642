#!/usr/bin/env bash
# How often a finished job on the emulated cluster exits non-zero at its end: OLD's and NEW's checkouts alternated,
# ROUNDS runs each, one DDP trial config (bf16 codec, 12 steps) on 4 x 1 hosts at 10 Gbit/s. Counts each run's exit
# code and the store errors (DistNetworkError traces) its agents printed. Needs root.
#   OLD=/tmp/wt_old NEW=/tmp/wt_new CONFIG=trial.toml ROUNDS=6 bash docs/repro/cluster_exit_race.sh
set -uo pipefail
ROUNDS=${ROUNDS:-6}
work=$(mktemp -d)
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="OLD NEW"; else order="NEW OLD"; fi
  for v in $order; do
    tree=${!v}
    OMP_NUM_THREADS=1 PYTHONPATH=$tree/src python -m dptrain.cli cluster --hosts 4 --per-host 1 --bandwidth-gbit 10 \
      -- -m dptrain.run --config "$CONFIG" --run-dir "$work/$v-$r" > "$work/$v-$r.out" 2>&1
    code=$?
    echo "round $r $v: exit $code, store errors $(grep -c 'DistNetworkError(' "$work/$v-$r.out"), finished $(grep -c '^  step time' "$work/$v-$r.out")"
  done
done
rm -rf "$work"
