#!/bin/bash
# Count hangs of backup mode with 2 servers (docs/async.md, "Answers that do not wait"): N runs of the command shown
# there, each under a 120 s timeout; a run that times out hung. Run it in a checkout of the commit to measure (the
# Outbox is in dptrain/ps/wire.py; before it, e.g. `git worktree add /tmp/before 3fa309d` and PYTHONPATH=/tmp/before/src,
# with checkpoint.every=0 there: that commit has no ps checkpoints).
#     bash docs/repro/ps_outbox_hang.sh 20 3        # runs, checkpoint.every
set -u
runs=${1:-20}
every=${2:-3}
out=$(mktemp -d)
hung=0
for i in $(seq 1 "$runs"); do
  timeout 120 dptrain run --nproc 5 --set distributed.strategy=ps --set ps.servers=2 --set ps.mode=backup --set ps.backups=1 \
    --set task.name=classifier --set train.steps=24 --set train.global_batch_size=15 --set straggler.rank=1 \
    --set straggler.factor=20 --set checkpoint.every="$every" --set log.plots=false --set log.progress=lines \
    --run-dir "$out/r$i" > "$out/r$i.log" 2>&1
  [ $? -eq 124 ] && hung=$((hung + 1))
done
echo "$hung of $runs runs hung (checkpoint.every=$every)"
rm -rf "$out"
