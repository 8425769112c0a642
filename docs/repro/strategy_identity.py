"""The strategies' final weights from two checkouts, byte for byte: did a refactor change what any strategy computes?

    python docs/repro/strategy_identity.py --before /path/to/old/checkout --after . --work /tmp/identity

For every case (a strategy with its options) it runs ``python -m dptrain.cli run`` for 12 steps
of the tiny GPT of ``docs/repro/tiny_hang.toml`` (dropout on: the random streams count too), 2
ranks (3 for the parameter server: a server and two workers), once from each checkout's
``src/`` (PYTHONPATH), and compares the SHA-256 of the two ``model.safetensors``. Prints one
line per case and exits 1 if any differs.

With ``--resume``, it also checks that a checkpoint written by the old checkout resumes in
the new one as the new one's own does: each checkout runs 6 steps (a checkpoint every 3),
the new one resumes both run directories to 12 steps, and the two final weights are
compared (a 6-step run's schedule ends at 6, so neither equals a straight 12-step run). Issue 47 (the strategy boundary) was checked this way
against the commit before it (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
CFG = HERE / "tiny_hang.toml"
COMMON = ["log.every=4", "log.plots=false", "distributed.timeout_s=60"]
CASES = {
    "ddp": (2, ["distributed.strategy=\"ddp\""]),
    "ddp-accum": (2, ["distributed.strategy=\"ddp\"", "train.grad_accum_steps=2"]),
    "zero1": (2, ["distributed.strategy=\"zero1\""]),
    "zero2": (2, ["distributed.strategy=\"zero2\""]),
    "zero3": (2, ["distributed.strategy=\"zero3\""]),
    "gossip": (2, ["distributed.strategy=\"gossip\""]),
    "ps-sync": (3, ["distributed.strategy=\"ps\""]),
    "powersgd": (2, ["distributed.strategy=\"ddp\"", "compression.method=\"powersgd\""]),
    "int8-zero2": (2, ["distributed.strategy=\"zero2\"", "compression.method=\"int8\""]),
    "onebit-adam": (2, ["distributed.strategy=\"ddp\"", "train.optimizer=\"onebit_adam\"", "train.onebit_freeze_step=4"]),
    "lamb": (2, ["distributed.strategy=\"ddp\"", "train.optimizer=\"lamb\"", "train.lr=0.01"]),
}


def run(src: Path, work: Path, nproc: int, overrides: list[str], steps: int = 12) -> str:
    """One run from ``src``; the SHA-256 of its model.safetensors (or what went wrong)."""
    env = dict(os.environ, PYTHONPATH=str(src.resolve() / "src"), OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "dptrain.cli", "run", "--nproc", str(nproc), "--config", str(CFG),
            "--run-dir", str(work)]
    for o in COMMON + overrides + [f"train.steps={steps}", "checkpoint.every=3"]:
        args += ["--set", o]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    weights = work / "model.safetensors"
    if done.returncode != 0 or not weights.exists():
        return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:] or ''}"
    return hashlib.sha256(weights.read_bytes()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--resume", action="store_true", help="also resume the old checkout's checkpoints")
    a = parser.parse_args()
    differ = 0
    for name in a.cases.split(","):
        nproc, overrides = CASES[name]
        before = run(a.before, a.work / name / "before", nproc, overrides)
        after = run(a.after, a.work / name / "after", nproc, overrides)
        same = before == after and not before.startswith("failed")
        differ += not same
        print(f"{name}: {'identical' if same else 'DIFFERENT'}  before {before[:16]}  after {after[:16]}", flush=True)
        if a.resume:  # the same 6 + 6 steps, the first 6 from each checkout, the last 6 from the new one
            resumed = []
            for first in (a.before, a.after):
                work = a.work / name / f"resumed-{'before' if first is a.before else 'after'}"
                run(first, work, nproc, overrides, steps=6)
                resumed.append(run(a.after, work, nproc, overrides))
            same = resumed[0] == resumed[1] and not resumed[0].startswith("failed")
            differ += not same
            print(f"{name} resumed by the new checkout from each one's step 6: "
                  f"{'identical' if same else 'DIFFERENT'}  {resumed[0][:16]}  {resumed[1][:16]}", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
