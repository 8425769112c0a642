#!/bin/bash
# The training loop, old against new, alternated (old first in odd pairs): a failure-free `dptrain run` of each
# strategy on 2 ranks, the classifier task (steps of a few ms: the loop's own cost is the largest share there is) and
# the default GPT. Usage, in an activated venv:
#   git worktree add /tmp/old58 3a8376d && OLD=/tmp/old58 PAIRS=3 OUT=/tmp/loop58 bash docs/repro/loop_speed.sh
#   OUT=/tmp/loop58 python docs/repro/loop_speed_summary.py
# STRATEGIES="ddp zero3" picks strategies; STEPS sets the classifier's steps (the GPT takes 40).
set -u
new=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=${OUT:-/tmp/loop_speed}; mkdir -p "$out"; rm -f "$out/progress.log"
cd /tmp
run() {  # old|new NAME ARGS...
  v=$1; shift; n=$1; shift
  if [ "$v" = old ]; then export PYTHONPATH=$OLD/src; else export PYTHONPATH=$new/src; fi
  rm -rf "$out/run_${n}_$v"
  python -m dptrain.cli run --nproc 2 --run-dir "$out/run_${n}_$v" --set log.plots=false --set checkpoint.every=0 \
    --set log.eval_every=0 --set log.trace_steps=0 --set log.progress=lines "$@" > "$out/${n}_$v.log" 2>&1
  cp "$out/run_${n}_$v/summary.json" "$out/${n}_$v.json" 2>/dev/null
  echo "$n $v done $(date +%T)" >> "$out/progress.log"
}
pair() {  # ROUND NAME ARGS...
  i=$1; shift; n=$1; shift
  if [ $((i % 2)) = 1 ]; then run old "$n" "$@"; run new "$n" "$@"; else run new "$n" "$@"; run old "$n" "$@"; fi
}
for i in $(seq 1 "${PAIRS:-3}"); do
  for s in ${STRATEGIES:-ddp zero2 zero3 localsgd diloco gossip}; do
    # the old layout's key: the new one reads it too (with a deprecation line)
    pair "$i" "cls_${s}_$i" --set ddp.strategy="$s" --set task.name=classifier --set train.steps="${STEPS:-300}"
    pair "$i" "gpt_${s}_$i" --set ddp.strategy="$s" --set train.steps=40 --set gpt.n_layer=2
  done
done
echo DONE >> "$out/progress.log"
