"""What a process's exit costs with and without the collector's freeze (dptrain.utils.collector), alternated.

    python docs/repro/exit_cost.py [ROUNDS]          # 6 by default; writes nothing, prints a table

Two programs, each run both ways in every round (ABBA order, alternating round by round), on a 4-step run of a
tiny GPT in a temporary directory:

- the worker, ``python -m dptrain.run`` as torchrun or Slurm starts it (frozen after its imports), against the same
  ``main()`` called from ``python -c`` (the module imported, not run as ``__main__``: no freeze);
- the command, ``python -m dptrain.cli run --nproc 1`` (frozen as it exits), against the same with
  ``freeze_at_exit`` replaced by a no-op.

Per run: the seconds from its last line of output to its exit, and its CPU seconds (``wait4``: the process and the
children it reaped). Prints each variant's median and the median of the paired ratios (frozen / not, the runs of
each round taken in pairs: 2 x ROUNDS pairs) with the lowest and highest pair.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """
[task]
name = "chargpt"
[gpt]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 16
corpus_bytes = 20000
[train]
steps = 4
global_batch_size = 8
[log]
plots = false
eval_every = 0
[checkpoint]
every = 0
"""

ARGS = ["--config", "tiny.toml", "--run-dir", "run"]
VARIANTS = {
    "worker frozen": [sys.executable, "-m", "dptrain.run", *ARGS],
    "worker not": [sys.executable, "-c", "import sys; from dptrain.run import main; sys.exit(main(sys.argv[1:]))", *ARGS],
    "command frozen": [sys.executable, "-m", "dptrain.cli", "run", "--nproc", "1", *ARGS],
    "command not": [sys.executable, "-c", "import importlib, sys; m = importlib.import_module('dptrain.cli.main'); "
                    "m.freeze_at_exit = lambda: None; m.main(sys.argv[1:], prog_name='dptrain')",
                    "run", "--nproc", "1", *ARGS],  # the module: `import dptrain.cli.main` names the command
}


def once(command: list[str], cwd: Path) -> tuple[float, float]:
    """(seconds from the last line of output to the exit, CPU seconds) of one run in a fresh run directory."""
    subprocess.run(["rm", "-rf", str(cwd / "run")], check=True)
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = time.monotonic()
    for _ in proc.stdout:
        last = time.monotonic()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{command} exited with status {status}")
    return time.monotonic() - last, usage.ru_utime + usage.ru_stime


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "tiny.toml").write_text(CONFIG)
        seen: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
        for r in range(rounds):
            for program in ("worker", "command"):
                order = ["frozen", "not"] if r % 2 == 0 else ["not", "frozen"]
                for way in order + order[::-1]:  # ABBA
                    seen[f"{program} {way}"].append(once(VARIANTS[f"{program} {way}"], cwd))
    print(f"{rounds} rounds, ABBA within each, the order flipped each round; medians of 2 x {rounds} runs")
    for program in ("worker", "command"):
        frozen, plain = seen[f"{program} frozen"], seen[f"{program} not"]
        for i, what in ((0, "exit s"), (1, "CPU s")):
            f = [x[i] for x in frozen]
            n = [x[i] for x in plain]
            ratios = [a / b for a, b in zip(f, n, strict=True)]
            print(f"{program:8s} {what:7s} frozen {statistics.median(f):.2f}  not {statistics.median(n):.2f}  "
                  f"ratio {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
