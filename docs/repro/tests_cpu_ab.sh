#!/usr/bin/env bash
# The machine's CPU seconds for a set of tests under two checkouts, alternated (ABBA...): what a change to the
# suite's costs saves. Each run is `python -m pytest -n $WORKERS` (0 by default) in that checkout, with its own src
# first on PYTHONPATH (fresh processes the tests start inherit it); the CPU is /proc/stat's busy time over the run,
# so processes that are not the test's children (forked workers, torchrun's) count too. Run it on an idle machine.
#
#     OLD=/path/to/old/checkout NEW=/path/to/new/checkout ROUNDS=2 bash docs/repro/tests_cpu_ab.sh TESTS...
#     OLD=... NEW=... WORKERS=2 bash docs/repro/tests_cpu_ab.sh     # the whole suite as CI runs it (-n 2)
#
# Prints one line per run: round, variant, CPU seconds, wall seconds.
set -euo pipefail
: "${OLD:?OLD: the checkout to compare against}" "${NEW:?NEW: the checkout with the change}"
ROUNDS=${ROUNDS:-2}
WORKERS=${WORKERS:-0}  # pytest-xdist workers (-n): 0 runs the tests in one process
busy() { awk 'NR==1{print ($2+$3+$4+$7+$8+$9)/100}' /proc/stat; }
for i in $(seq 1 "$ROUNDS"); do
    if ((i % 2)); then order="old new"; else order="new old"; fi
    for v in $order; do
        if [ "$v" = old ]; then dir=$OLD; else dir=$NEW; fi
        b0=$(busy); t0=$(date +%s.%N)
        log="${TMPDIR:-/tmp}/tests_cpu_ab.$i.$v.log"  # pytest's output, kept to say what failed
        (cd "$dir" && PYTHONPATH="$dir/src" python -m pytest -q -n "$WORKERS" -p no:cacheprovider "$@" >"$log" 2>&1) \
            || echo "round $i $v: the tests failed (their output: $log)"
        b1=$(busy); t1=$(date +%s.%N)
        echo "round $i $v cpu $(echo "$b1 - $b0" | bc) s wall $(echo "$t1 - $t0" | bc) s"
    done
done
