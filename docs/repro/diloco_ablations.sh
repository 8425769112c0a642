#!/usr/bin/env bash
# DiLoCo's gap to DDP, ablated (docs/localsgd.md, "Why DiLoCo trails DDP here: the ablations"): 2 ranks, the
# default GPT, 1,500 steps of global batch 32, equal tokens; each DiLoCo variant one change from H = 30, outer lr
# 0.6, Nesterov momentum 0.9. Each run's final validation loss (of the exported weights: DiLoCo's global ones) goes
# to $OUT/<variant>.json; python docs/repro/diloco_ablations_summary.py $OUT writes the table. About 4.5 minutes a
# run on a 2-core machine. VARIANTS picks some (names below); WORK holds the run directories; EXTRA is added to
# every run of the call (another model: EXTRA="--set gpt.n_layer=8" STEPS=1000); NPROC the ranks (replicas M, 2
# by default; the global batch stays 32).
set -euo pipefail
OUT=${OUT:-bench_results/diloco_ablations}
WORK=${WORK:-/tmp/diloco_ablations}
STEPS=${STEPS:-1500}
EXTRA=${EXTRA:-}
NPROC=${NPROC:-2}
TAG=$(echo "$EXTRA" | tr -c 'a-z0-9.=_\n' '_' | sed 's/__*/_/g; s/_set_/_/g; s/^_//')
if [ "$NPROC" != 2 ]; then TAG="m$NPROC${TAG:+_$TAG}"; fi
mkdir -p "$OUT" "$WORK"
D=(--set distributed.strategy=diloco --set diloco.period=30 --set diloco.outer_lr=0.6 --set diloco.outer_momentum=0.9)
declare -A V=(
  [ddp]=""
  [diloco]="${D[*]}"
  [average]="${D[*]} --set diloco.outer_lr=1.0 --set diloco.outer_momentum=0"
  [plain-momentum]="${D[*]} --set diloco.nesterov=false"
  [momentum0.5]="${D[*]} --set diloco.outer_momentum=0.5"
  [momentum0.7]="${D[*]} --set diloco.outer_momentum=0.7"
  [momentum0.5-h10]="${D[*]} --set diloco.outer_momentum=0.5 --set diloco.period=10"
  [momentum0.5-batch64]="${D[*]} --set diloco.outer_momentum=0.5 --set train.global_batch_size=64"
  [inner-lr-half]="${D[*]} --set train.lr=0.001"
  [h10]="${D[*]} --set diloco.period=10"
  [h100]="${D[*]} --set diloco.period=100"
  [sync-start]="${D[*]} --set diloco.warmup_steps=150"
  [momentum0.5-sync-start]="${D[*]} --set diloco.outer_momentum=0.5 --set diloco.warmup_steps=150"
  [ddp-warmup150]="--set train.warmup_steps=150"
  [diloco-warmup150]="${D[*]} --set train.warmup_steps=150"
  [average-h10]="${D[*]} --set diloco.period=10 --set diloco.outer_lr=1.0 --set diloco.outer_momentum=0"
  [average-batch64]="${D[*]} --set diloco.outer_lr=1.0 --set diloco.outer_momentum=0 --set train.global_batch_size=64"
  [ddp-batch64]="--set train.global_batch_size=64"
  [diloco-batch64]="${D[*]} --set train.global_batch_size=64"
  [lr0.2]="${D[*]} --set diloco.outer_lr=0.2"
  [momentum0.7-sync-start]="${D[*]} --set diloco.outer_momentum=0.7 --set diloco.warmup_steps=150"
  [momentum0.7-e3m0]="${D[*]} --set diloco.outer_momentum=0.7 --set diloco.compression=e3m0"
  [momentum0.7-f2]="${D[*]} --set diloco.outer_momentum=0.7 --set diloco.fragments=2"
  [streaming-e3m0-no-overlap]="${D[*]} --set diloco.outer_momentum=0.7 --set diloco.fragments=2 --set diloco.compression=e3m0"
  [streaming-e3m0]="${D[*]} --set diloco.outer_momentum=0.7 --set diloco.fragments=2 --set diloco.overlap_steps=1 --set diloco.compression=e3m0"
  [streaming-e3m0-mix]="${D[*]} --set diloco.outer_momentum=0.7 --set diloco.fragments=2 --set diloco.overlap_steps=1 --set diloco.compression=e3m0 --set diloco.mixing=0.5"
)
for name in ${VARIANTS:-ddp diloco average plain-momentum momentum0.5 inner-lr-half sync-start}; do
  run="$WORK/$name-$STEPS${TAG:+-$TAG}"
  rm -rf "$run"
  start=$SECONDS
  # shellcheck disable=SC2086
  dptrain run --nproc "$NPROC" --run-dir "$run" --set train.steps="$STEPS" --set log.trace_steps=0 ${V[$name]} $EXTRA > "$run.log" 2>&1
  python - "$run" "$OUT/$name-$STEPS${TAG:+-$TAG}.json" "$name" "${V[$name]}" $((SECONDS - start)) "$EXTRA" "$NPROC" <<'PY'
import json, sys
run, out, name, settings, wall, extra, nproc = sys.argv[1:]
s = json.loads(open(f"{run}/summary.json").read())
evals = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"eval"' in l]
json.dump({"variant": name, "settings": settings, "model": extra, "replicas": int(nproc), "steps": s["steps"], "parameters": s["parameters"], "val_loss": s["val_loss"],
           "evals": {e["step"]: e["val_loss"] for e in evals if "val_loss" in e},
           "comm_bytes_per_step": s.get("comm_bytes_per_step"), "wall_s": int(wall)}, open(out, "w"), indent=1)
print(name, s["val_loss"])
PY
done
