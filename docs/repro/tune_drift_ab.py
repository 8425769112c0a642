"""Whether the machine or the code moved a step: one DDP config on the emulated 4 x 1 cluster at 10 Gbit/s, run by an
old checkout and a new one, alternated (ABBA, the order flipped each round), as the tuner's trials run (one torch
thread a rank). Needs root.

    OLD=/tmp/wt_old NEW=/tmp/wt_new python docs/repro/tune_drift_ab.py [ROUNDS] [local]

Each run: the larger GPT of docs/tune.md's space (8 x 256, global batch 16, micro-batch 4), DDP at 25 MiB, 20 steps;
the median of the slowest rank's step_ms after 4, and the job's wall time from start to exit.
"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

trees = {"old": os.environ["OLD"] + "/src", "new": os.environ["NEW"] + "/src"}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
extra = sys.argv[2:]  # e.g. cluster or local
sets = ["gpt.n_layer=8", "gpt.n_embd=256", "train.global_batch_size=16", "train.micro_batch_size=4",
        "ddp.bucket_cap_mb=25", "train.steps=20", "checkpoint.every=0", "log.every=1", "log.eval_every=0",
        "log.eval_batches=1", "log.plots=false", "log.trace_steps=0"]
res = {"old": [], "new": []}
for r in range(rounds):
    order = ["old", "new", "new", "old"] if r % 2 == 0 else ["new", "old", "old", "new"]
    for v in order:
        rd = Path(os.environ.get("TMPDIR", "/tmp")) / "tune_drift" / f"{v}-{r}-{time.time_ns()}"
        env = dict(os.environ, PYTHONPATH=trees[v], OMP_NUM_THREADS="1")
        args = [a for s in sets for a in ("--set", s)]
        if extra and extra[0] == "local":
            cmd = [sys.executable, "-m", "dptrain.cli", "run", "--nproc", "4", "--run-dir", str(rd), *args]
        else:
            cmd = [sys.executable, "-m", "dptrain.cli", "cluster", "--hosts", "4", "--per-host", "1",
                   "--bandwidth-gbit", "10", "--", "-m", "dptrain.run", "--run-dir", str(rd), *args]
        t0 = time.time()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp")
        wall = time.time() - t0
        recs = [json.loads(l) for l in (rd / "metrics.jsonl").read_text().splitlines() if l.strip()]
        st = [x["step_ms"] for x in recs if x.get("kind") == "train" and x["step"] > 4]
        med = statistics.median(st)
        res[v].append(med)
        print(f"round {r} {v}: median step {med:.1f} ms, wall {wall:.1f} s, rc {p.returncode}", flush=True)
for v in res:
    print(v, [round(x, 1) for x in res[v]], "median", round(statistics.median(res[v]), 1))
ratios = [n / o for n, o in zip(res["new"], res["old"], strict=True)]
print("new/old paired ratios", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
