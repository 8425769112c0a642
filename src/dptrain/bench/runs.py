"""One ``dptrain run`` as a benchmark step: the real command line, its summary and metrics back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["dptrain_run", "dptrain_command", "toml_value", "Raw"]


class Raw(str):
    """A value already in ``--set`` syntax (from the command line), passed on as it is."""


def toml_value(value) -> str:
    """A Python value as ``--set`` takes it (TOML syntax)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def dptrain_command(nproc: int, settings: dict[str, object], run_dir: Path) -> list[str]:
    """``dptrain run`` on ``nproc`` ranks in ``run_dir``, with ``--set key=value`` for each setting."""
    args = [sys.executable, "-m", "dptrain.cli", "run", "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for key, value in settings.items():
        args += ["--set", f"{key}={toml_value(value)}"]
    return args


def dptrain_run(nproc: int, settings: dict[str, object], run_dir: Path) -> dict:
    """Run ``dptrain run`` with ``--set key=value`` for each setting; returns summary, train records, wall time."""
    args = dptrain_command(nproc, settings, run_dir)
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dptrain run with {settings} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "train": [r for r in records if r.get("kind") == "train"], "wall_s": time.perf_counter() - t0}
