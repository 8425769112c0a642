"""docs/repro/gpu_check.sh rehearsed on the CPU (``DPTRAIN_GPU_CHECK_DRY=1``): every step runs but the install
and the launch-bound bench (the first bench's command on other sizes), the results folder holds what the device tool
can bring back (at most 8 files), and the summary says all is well."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # fresh interpreters: a nested pytest, the benchmarks, the profiler script
@pytest.mark.timeout(150)
def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "DPTRAIN_GPU_CHECK_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", str(ROOT / "docs" / "repro" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)  # measured: 41 s on a busy 2-core machine
    log = (tmp_path / "check.log").read_text() if (tmp_path / "check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-4000:]
    assert "ALL STEPS OK" in proc.stdout and "0 failed, 1 skipped" in proc.stdout, proc.stdout
    assert "no result" not in proc.stdout, proc.stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    # the rehearsal runs the benchmark once (on a device three times, and once launch-bound: bench_small)
    assert names == ["bench_1.json", "check.log", "profile.json", "summary.txt"], names
    assert (tmp_path / "summary.txt").read_text() == proc.stdout
