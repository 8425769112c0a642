#!/usr/bin/env bash
# Start a tiny GPT job, SIGSTOP one rank once it trains, and time how long the job takes to end.
# usage: bash docs/repro/stop_rank.sh RUN_DIR RANK NPROC [dptrain run options, e.g. --set distributed.strategy=ps]
# (docs/reliability.md, "Every hang ends"; distributed.timeout_s = 10 in docs/repro/tiny_hang.toml)
set -u
rd=$1; r=$2; n=$3; shift 3
cfg=$(dirname "$0")/tiny_hang.toml
rm -rf "$rd"
dptrain run --config "$cfg" --nproc "$n" --run-dir "$rd" "$@" > "$rd.out" 2>&1 &
launcher=$!
until [ -f "$rd/logs/rank$r.heartbeat" ]; do sleep 1; done
sleep 6
pid=$(python -c "import json; print(json.load(open('$rd/logs/rank$r.heartbeat'))['pid'])")
t0=$(date +%s.%N); kill -STOP "$pid"
wait $launcher; rc=$?
t1=$(date +%s.%N)
echo "exit $rc, $(python -c "print(round($t1 - $t0, 1))") s after the SIGSTOP of rank $r"
grep -A1 "^error" "$rd.out"
