"""Running the real ``dptrain`` command line from tests, on tiny configs.

:func:`dptrain` calls the command's entry point in this process
(:func:`dptrain.bench.runs.run_cli`), with the arguments, working directory and environment
the test gives and its output (the workers' too) captured, and returns what
``subprocess.run`` would. The launcher forks its workers from this process's fork server,
which has torch imported already: a run costs its training, not three or four interpreter
starts (docs/testing.md). What only a new process shows (``python -m dptrain.cli``, an
interpreter's exit) is covered by the tests that pass ``fresh=True``; ``exec`` workers (fresh
interpreters, whoever launches them) by those that pass ``--start-method exec`` or ``--max-restarts``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dptrain.bench.runs import run_cli

TESTS = Path(__file__).parent

# A 2-block byte-level GPT (about 30k parameters) on 100 kB of stdlib source, with dropout
# (so resumption must restore RNG streams) and tiny buckets (so there are many). No plots:
# they cost a run 0.35 s in process, 1.8 s in a fresh one (docs/testing.md); the end-to-end
# test turns them on and checks them.
# A failed collective's roll call waits 1 s, not 3: every rank that can report does so at once.
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
[distributed]
roll_call_s = 1.0
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


def dptrain(*args: str, cwd: Path, env: dict | None = None, timeout: float = 150,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """``dptrain ARGS`` as a user would run it; returns the finished command (text output).

    ``fresh``: in a new interpreter (``python -m dptrain.cli``) instead of this process.
    ``timeout`` bounds a fresh process; in process, the test's own timeout does.
    """
    full_env = {k: v for k, v in os.environ.items() if k != "DPTRAIN_FAULT"}
    full_env.update(PYTHONPATH=os.pathsep.join([str(TESTS), *filter(None, [full_env.get("PYTHONPATH")])]),
                    **(env or {}))
    if fresh:
        return subprocess.run([sys.executable, "-m", "dptrain.cli", *args], cwd=cwd, env=full_env, text=True,
                              capture_output=True, timeout=timeout)
    return run_cli(list(args), Path(cwd), full_env)


# The studies' smoke tests run their variants on the smallest GPT that still trains.
TINY_GPT_SETTINGS = ["gpt.n_layer=1", "gpt.n_head=2", "gpt.n_embd=16", "gpt.block_size=8", "gpt.corpus_bytes=20000",
                     "log.eval_batches=1"]


def tiny_gpt_config(directory: Path, extra: str = "") -> Path:
    path = directory / "tiny.toml"
    path.write_text(TINY_GPT + extra)
    return path
