#!/usr/bin/env bash
# Wall time of examples/custom_loop.py on 2 workers, started three ways, interleaved (docs/launch.md).
# Usage: bash docs/repro/launch_start_cost.sh [rounds]   (from the repository root, the venv active)
set -euo pipefail
rounds=${1:-3}
declare -A runs=(
  [launch-exec]="dptrain launch --nproc 2 --run-dir /tmp/launch_cost examples/custom_loop.py"
  [launch-forkserver]="dptrain launch --nproc 2 --start-method forkserver --run-dir /tmp/launch_cost examples/custom_loop.py"
  [torchrun]="torchrun --standalone --nproc-per-node 2 examples/custom_loop.py"
)
for ((i = 1; i <= rounds; i++)); do
  for name in launch-exec launch-forkserver torchrun; do
    start=$(date +%s.%N)
    ${runs[$name]} > /dev/null 2>&1
    echo "$name $(echo "$(date +%s.%N) - $start" | bc)"
  done
done | sort | awk '{t[$1] = t[$1] " " sprintf("%.2f", $2)} END {for (k in t) print k ":" t[k] " s"}'
