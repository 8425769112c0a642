#!/bin/bash
# The redesign of issue 37, old against new, alternated (ABBA by round): the DDP benchmark on the default MLP
# (3 runs) and on many small parameters (2 runs), and ZeRO 1-3 (3 runs). Usage, in an activated venv:
#   git worktree add /tmp/old37 f909203 && OLD=/tmp/old37 bash docs/repro/redesign_speed.sh
#   python docs/repro/redesign_speed_summary.py
set -u
new=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=${OUT:-/tmp/redesign_speed}; mkdir -p "$out"; rm -f "$out/progress.log"
cd /tmp
run() {  # old|new NAME BENCH ARGS...
  v=$1; shift; n=$1; shift
  if [ "$v" = old ]; then export PYTHONPATH=$OLD/src; else export PYTHONPATH=$new/src; fi
  python -m dptrain.cli bench "$@" --out "$out/${n}_$v.json" > "$out/${n}_$v.log" 2>&1
  echo "$n $v done" >> "$out/progress.log"
}
pair() {  # ROUND NAME BENCH ARGS...: old first in odd rounds, new first in even ones
  i=$1; shift; n=$1; shift
  if [ $((i % 2)) = 1 ]; then run old "$n" "$@"; run new "$n" "$@"; else run new "$n" "$@"; run old "$n" "$@"; fi
}
for i in 1 2 3; do pair $i mlp$i ddp --rounds 12; done
for i in 1 2; do pair $i sp$i ddp --model small-params --width 64 --depth 200 --micro-batch 8; done
for i in 1 2 3; do pair $i zero$i zero --variants dptrain_zero1 dptrain_zero2 dptrain_zero3 --rounds 8; done
echo DONE >> "$out/progress.log"
