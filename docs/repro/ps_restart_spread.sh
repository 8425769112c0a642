#!/bin/bash
# Async PS restarts against the run-to-run spread (docs/async.md, "Checkpoints and restarts"): the final validation
# loss of N uninterrupted runs and of N runs whose server is killed at step 45 of 60 and restarted under
# --max-restarts (resumed from the step-40 checkpoint), interleaved; same config and seed throughout.
#     bash docs/repro/ps_restart_spread.sh 5
set -eu
n=${1:-5}
out=$(mktemp -d)
common=(--nproc 3 --set distributed.strategy=ps --set ps.mode=async --set task.name=chargpt --set gpt.n_layer=2
        --set gpt.n_head=2 --set gpt.n_embd=32 --set gpt.block_size=16 --set gpt.dropout=0.1
        --set gpt.corpus_bytes=100000 --set train.steps=60 --set train.global_batch_size=16
        --set train.warmup_steps=6 --set checkpoint.every=20 --set log.every=10 --set log.eval_batches=8
        --set log.progress=lines --set log.plots=false)
for i in $(seq 1 "$n"); do
  dptrain run "${common[@]}" --run-dir "$out/straight$i" > "$out/straight$i.log" 2>&1
  dptrain run "${common[@]}" --run-dir "$out/killed$i" --max-restarts 1 --fault 2:45:kill > "$out/killed$i.log" 2>&1
done
python - "$out" "$n" <<'PY'
import json, statistics, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
for kind in ("straight", "killed"):
    runs = [json.loads((out / f"{kind}{i}" / "summary.json").read_text()) for i in range(1, n + 1)]
    vals = [r["val_loss"] for r in runs]
    resumed = f"; resumed at steps {[r['start_step'] for r in runs]}" if kind == "killed" else ""
    print(f"{kind:9s} val_loss {' '.join(f'{v:.4f}' for v in vals)}; median {statistics.median(vals):.4f}, "
          f"range {min(vals):.4f}-{max(vals):.4f}{resumed}")
PY
rm -rf "$out"
