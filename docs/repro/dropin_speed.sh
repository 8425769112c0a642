#!/bin/bash
# Issue 48's hot path, old (85461f9) against new, alternated (ABBA by pair): the DDP benchmark on the default MLP
# at 1, 4 and 25 MiB buckets, and on many small parameters. Usage, in an activated venv:
#   git worktree add /work/base48 85461f9 && OLD=/work/base48 PAIRS=4 bash docs/repro/dropin_speed.sh
#   OUT=/tmp/dropin_speed python docs/repro/dropin_speed_summary.py
set -u
new=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=${OUT:-/tmp/dropin_speed}; mkdir -p "$out"; rm -f "$out/progress.log"
pairs=${PAIRS:-4}
cd /tmp
run() {  # old|new NAME BENCH ARGS...
  v=$1; shift; n=$1; shift
  if [ "$v" = old ]; then export PYTHONPATH=$OLD/src; else export PYTHONPATH=$new/src; fi
  nice -n 19 python -m dptrain.cli bench "$@" --out "$out/${n}_$v.json" > "$out/${n}_$v.log" 2>&1
  echo "$n $v done $(date +%T)" >> "$out/progress.log"
}
pair() {  # ROUND NAME BENCH ARGS...: old first in odd rounds, new first in even ones
  i=$1; shift; n=$1; shift
  if [ $((i % 2)) = 1 ]; then run old "$n" "$@"; run new "$n" "$@"; else run new "$n" "$@"; run old "$n" "$@"; fi
}
for i in $(seq "${FIRST:-1}" "$pairs"); do  # FIRST=5 PAIRS=8: four more pairs after a first batch
  pair "$i" "mlp$i" ddp --caps 1 4 25 --rounds 10
  pair "$i" "sp$i" ddp --model small-params --width 64 --depth 200 --micro-batch 8 --caps 1 4 25 --rounds 10 --steps 3
done
echo DONE >> "$out/progress.log"
