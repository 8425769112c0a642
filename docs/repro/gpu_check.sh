#!/usr/bin/env bash
# The GPU check (issue 39, docs/gpu.md): everything a lent GPU machine should run, in one call, under 8 minutes.
#
#     bash docs/repro/gpu_check.sh                              # on the lent machine (no arguments)
#     DPTRAIN_GPU_CHECK_DRY=1 bash docs/repro/gpu_check.sh      # the same steps on the CPU, tiny sizes
#
# Steps, each under its own time limit, all of them under one deadline (DEADLINE_S, 450 s):
#   1. pip install -e .[test] (where there is no index: dptrain alone, without dependencies, plus any wheels
#      carried in .whl/; the dry run installs nothing);
#   2. the GPU tests: pytest -m gpu tests/test_gpu.py tests/test_gpu_run.py;
#   3. dptrain bench gpu three times on the 85.6M GPT (batch 16 x 512), and once launch-bound (batch 1 x 128);
#   4. the torch profiler's self CPU time per step and parameter tensor, dptrain's DDP and torch's
#      (docs/repro/gpu_profile_ddp.py).
# Writes into $OUT when set, else bench_results/gpu/<date>: check.log (every step's output), bench_1..3.json,
# bench_small.json, profile.json, summary.txt (7 files: the device tool brings back at most 8; the CPU rehearsal
# writes 4, bench_2, bench_3 and bench_small left out). Prints the
# summary at the end. Exits 1 when a step failed.
set -u
cd "$(dirname "$0")/../.."
DRY=${DPTRAIN_GPU_CHECK_DRY:-0}
PY=${PYTHON:-python3}
RESULTS=${OUT:-bench_results/gpu/$(date +%Y-%m-%d)}
DEADLINE_S=${DEADLINE_S:-450}
mkdir -p "$RESULTS"
LOG="$RESULTS/check.log"
STEPS=$(mktemp)
JUNIT=$(mktemp --suffix=.xml)
trap 'rm -f "$STEPS" "$JUNIT"' EXIT
: >"$LOG"
export PYTHONUNBUFFERED=1
START=$(date +%s)

# step NAME LIMIT_S COMMAND...: run it under min(LIMIT_S, what the deadline leaves), output into check.log
step() {
    local name=$1 limit=$2 t0 left rc
    shift 2
    t0=$(date +%s)
    left=$((DEADLINE_S - (t0 - START)))
    if ((left < 15)); then
        echo "$name|skipped: the deadline|0" >>"$STEPS"
        return
    fi
    ((limit > left)) && limit=$left
    echo "===== $name (limit ${limit} s): $*" >>"$LOG"
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    ((rc == 124 || rc == 137)) && rc="timed out after ${limit} s"
    echo "$name|$rc|$(($(date +%s) - t0))" >>"$STEPS"
}

install() {
    PIP_DEFAULT_TIMEOUT=5 PIP_RETRIES=0 "$PY" -m pip install -q -e '.[test]' && return
    echo "no package index: installing dptrain without its dependencies, and the wheels in .whl/ if any"
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return
    if [ -d .whl ]; then "$PY" -m pip install -q --no-index --no-deps .whl/*.whl; fi
}

if [ "$DRY" = 1 ]; then
    export OMP_NUM_THREADS=1  # one thread per process: the CPU rehearsal stays fast beside other work
    DEVICE=(--device cpu)
    BIG=(--rounds 2 --steps 2 --parity-steps 1 --n-layer 1 --n-embd 32 --batch 2 --block 16)
    PROFILE=(--n-layer 1 --n-embd 32 --batch 2 --block 16 --steps 2)
    PYTEST=(-n 0)  # one process: on a CPU the tests' own ranks share the cores, and two pytest workers cost 2 starts
    echo "install|skipped: dry run|0" >>"$STEPS"
else
    DEVICE=(--device cuda)
    BIG=(--rounds 15)                                         # 12 layers x 768: 85.6M parameters, batch 16 x 512
    SMALL=(--rounds 15 --parity-steps 2 --batch 1 --block 128)  # the same GPT, too little work to hide launches
    PROFILE=()
    PYTEST=()
    step install 45 install
fi

step "gpu tests" 150 "$PY" -m pytest -m gpu tests/test_gpu.py tests/test_gpu_run.py -q -p no:cacheprovider \
    "${PYTEST[@]}" --junitxml="$JUNIT"
# three runs on the device; one in the CPU rehearsal, which checks that the step works, not its spread
for i in $(seq 1 "$( [ "$DRY" = 1 ] && echo 1 || echo 3 )"); do
    step "bench gpu $i" 60 "$PY" -m dptrain.cli bench gpu "${DEVICE[@]}" "${BIG[@]}" --out "$RESULTS/bench_$i.json"
done
# the launch-bound case: on the device only (the rehearsal's one bench run above checks the same command)
if [ "$DRY" = 1 ]; then
    echo "bench gpu, launch-bound|skipped: dry run|0" >>"$STEPS"
else
    step "bench gpu, launch-bound" 45 "$PY" -m dptrain.cli bench gpu "${DEVICE[@]}" "${SMALL[@]}" \
        --out "$RESULTS/bench_small.json"
fi
step profile 45 "$PY" docs/repro/gpu_profile_ddp.py "${DEVICE[@]}" "${PROFILE[@]}" --json "$RESULTS/profile.json"

"$PY" docs/repro/gpu_check_summary.py "$RESULTS" "$STEPS" "$JUNIT" "$(($(date +%s) - START))" \
    | tee "$RESULTS/summary.txt"
exit "${PIPESTATUS[0]}"
