"""The example for users who write their own loop runs and learns."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher, ranks, accum", [([], 1, 4), (["-m", "dptrain.cli", "launch", "--nproc", "2"], 2, 2)],
                         ids=["python", "dptrain-launch"])
def test_custom_loop_example_trains(launcher, ranks, accum, tmp_path):
    proc = subprocess.run([sys.executable, *launcher, str(EXAMPLES / "custom_loop.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0]
    assert f"global batch 128 = micro 32 x {ranks} ranks x {accum} accum; skipped steps: 0" in proc.stdout
