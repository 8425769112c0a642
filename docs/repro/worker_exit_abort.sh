#!/usr/bin/env bash
# How often `python -m dptrain.run` aborts after a finished run (SIGABRT, "terminate called without an active
# exception"; docs/notes.md): OLD's and NEW's checkouts alternated, ROUNDS torchrun jobs each, 4 ranks on this
# machine, one DDP trial config with the bf16 codec (12 steps).
#   OLD=/tmp/wt_old NEW=/tmp/wt_new CONFIG=trial.toml ROUNDS=10 bash docs/repro/worker_exit_abort.sh
set -uo pipefail
ROUNDS=${ROUNDS:-10}
work=$(mktemp -d)
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="OLD NEW"; else order="NEW OLD"; fi
  for v in $order; do
    tree=${!v}
    OMP_NUM_THREADS=1 PYTHONPATH=$tree/src python -m torch.distributed.run --standalone --nproc-per-node 4 \
      -m dptrain.run --config "$CONFIG" --run-dir "$work/run-$v-$r" > "$work/$v.$r.out" 2>&1
    echo "round $r $v: exit $?, aborted ranks $(grep -c 'terminate called' "$work/$v.$r.out")"
  done
done
rm -rf "$work"
