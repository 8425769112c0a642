"""Running the real ``dptrain`` command line from tests, on tiny configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

# A 2-block byte-level GPT (about 30k parameters) on 100 kB of stdlib source, with dropout
# (so resumption must restore RNG streams) and tiny buckets (so there are many). No plots:
# they cost every run a second or two; the end-to-end test turns them on and checks them.
TINY_GPT = """
[task]
name = "chargpt"
[gpt]
n_layer = 2
n_head = 2
n_embd = 32
block_size = 16
dropout = 0.1
corpus_bytes = 100000
[train]
steps = 20
global_batch_size = 8
warmup_steps = 4
[ddp]
bucket_cap_mb = 0.02
[log]
every = 1
eval_every = 10
eval_batches = 2
trace_start = 3
trace_steps = 2
progress = "lines"
plots = false
[checkpoint]
every = 10
keep_last = 2
"""


def dptrain(*args: str, cwd: Path, env: dict | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    """``dptrain ARGS`` as a user would run it; returns the finished process (text output)."""
    full_env = {k: v for k, v in os.environ.items() if k != "DPTRAIN_FAULT"}
    full_env.update(PYTHONPATH=str(TESTS), **(env or {}))
    return subprocess.run([sys.executable, "-m", "dptrain.cli", *args], cwd=cwd, env=full_env, text=True,
                          capture_output=True, timeout=timeout)


def tiny_gpt_config(directory: Path, extra: str = "") -> Path:
    path = directory / "tiny.toml"
    path.write_text(TINY_GPT + extra)
    return path
