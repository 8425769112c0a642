#!/bin/bash
# Issue 38's measurements, in one run on a quiet machine. Usage, in an activated venv:
#   git worktree add /tmp/old38 835b2e4 && OLD=/tmp/old38 bash docs/repro/schedule_speed.sh
#   python docs/repro/schedule_speed_summary.py
# A. The hot path, old (835b2e4) against new, alternated (ABBA by pair): the DDP benchmark at 1/4/25 MiB on
#    the default MLP (2 pairs) and on many small parameters (1 pair), ZeRO 1-3 (2 pairs).
# B. dptrain/torch with the scheduling options (a 1 MiB last bucket, the optimizer in backward), three runs
#    on each MLP, the held-out pairs protocol three times, and one timeline of each MLP at 25 MiB.
set -u
new=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=${OUT:-/tmp/schedule_speed}; mkdir -p "$out"; rm -f "$out/progress.log"
cd /tmp
run() {  # old|new NAME BENCH ARGS...
  v=$1; shift; n=$1; shift
  if [ "$v" = old ]; then export PYTHONPATH=$OLD/src; else export PYTHONPATH=$new/src; fi
  start=$(date +%s)
  python -m dptrain.cli bench "$@" --out "$out/${n}_$v.json" > "$out/${n}_$v.log" 2>&1
  echo "$n $v done in $(( $(date +%s) - start )) s" >> "$out/progress.log"
}
pair() {  # ROUND NAME BENCH ARGS...: old first in odd rounds, new first in even ones
  i=$1; shift; n=$1; shift
  if [ $((i % 2)) = 1 ]; then run old "$n" "$@"; run new "$n" "$@"; else run new "$n" "$@"; run old "$n" "$@"; fi
}
if [ -n "${OLD:-}" ]; then
  for i in 1 2; do pair $i mlp$i ddp --rounds 10; done
  pair 1 sp1 ddp --model small-params --width 64 --depth 200 --micro-batch 8 --rounds 10
  for i in 1 2; do pair $i zero$i zero --variants dptrain_zero1 dptrain_zero2 dptrain_zero3 --rounds 6; done
fi
SCHED=(--last-bucket 1 --in-backward --rounds 10)
FFN=(--model mlp-ffn --width 512 --depth 8 --micro-batch 64)
for i in 1 2 3; do
  run new sched_mlp$i ddp "${SCHED[@]}"
  run new sched_ffn$i ddp "${FFN[@]}" "${SCHED[@]}"
  run new heldout$i ddp --held-out
done
run new timeline_mlp ddp-timeline --cap 25
run new timeline_ffn ddp-timeline "${FFN[@]}" --cap 25
echo DONE >> "$out/progress.log"
