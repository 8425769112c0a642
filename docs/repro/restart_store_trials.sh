#!/bin/bash
# Restarts with torch's shared rendezvous store against a fresh one (docs/reliability.md, "The rendezvous store").
# Each trial: 2 ranks, rank 1 killed at step 7 of 12, one restart allowed. Prints one line per trial.
#     bash docs/repro/restart_store_trials.sh 6
set -u
trials=${1:-6}
dir=$(mktemp -d)
for i in $(seq 1 "$trials"); do
  for store in shared fresh; do
    flag=0; [ "$store" = fresh ] && flag=1
    start=$(date +%s.%N)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$flag DPTRAIN_FAULT=1:7:kill timeout 120 \
      dptrain run --nproc 2 --max-restarts 1 --run-dir "$dir/$store$i" --set task.name=classifier \
      --set train.steps=12 --set checkpoint.every=3 --set log.progress=lines --set log.plots=false \
      > "$dir/$store$i.log" 2>&1
    code=$?
    echo "$store store, trial $i: exit $code after $(echo "$(date +%s.%N) - $start" | bc) s"
  done
done
rm -rf "$dir"
