#!/bin/bash
# A change to the hot path, old against new, alternated (old first in odd pairs): the DDP benchmark on the default
# MLP at 1, 4 and 25 MiB buckets and on 800 small parameters, and ZeRO 1-3. Usage, in an activated venv:
#   git worktree add /tmp/pre47 fe75bc4 && OLD=/tmp/pre47 PAIRS=2 OUT=/tmp/hot47 bash docs/repro/hotpath_speed.sh
#   OUT=/tmp/hot47 python docs/repro/hotpath_speed_summary.py     # DDP: dptrain/torch per run, new/old per pair
#   OUT=/tmp/hot47 python docs/repro/redesign_speed_summary.py   # ZeRO: new/old of each stage's median step
# ZERO=0 leaves ZeRO out; FIRST=5 PAIRS=8 runs four more pairs after a first batch; NICE=19 yields to other jobs.
set -u
new=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=${OUT:-/tmp/hotpath_speed}; mkdir -p "$out"; rm -f "$out/progress.log"
pairs=${PAIRS:-2}
cd /tmp
run() {  # old|new NAME BENCH ARGS...
  v=$1; shift; n=$1; shift
  if [ "$v" = old ]; then export PYTHONPATH=$OLD/src; else export PYTHONPATH=$new/src; fi
  nice -n "${NICE:-0}" python -m dptrain.cli bench "$@" --out "$out/${n}_$v.json" > "$out/${n}_$v.log" 2>&1
  echo "$n $v done $(date +%T)" >> "$out/progress.log"
}
pair() {  # ROUND NAME BENCH ARGS...: old first in odd rounds, new first in even ones
  i=$1; shift; n=$1; shift
  if [ $((i % 2)) = 1 ]; then run old "$n" "$@"; run new "$n" "$@"; else run new "$n" "$@"; run old "$n" "$@"; fi
}
for i in $(seq "${FIRST:-1}" "$pairs"); do
  pair "$i" "mlp$i" ddp --caps 1 4 25 --rounds 10
  pair "$i" "sp$i" ddp --model small-params --width 64 --depth 200 --micro-batch 8 --caps 1 4 25 --rounds 10 --steps 3
  [ "${ZERO:-1}" = 0 ] || pair "$i" "zero$i" zero --variants dptrain_zero1 dptrain_zero2 dptrain_zero3 --rounds 8
done
echo DONE >> "$out/progress.log"
