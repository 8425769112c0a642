"""The example for users who write their own loop runs and learns."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.slow
def test_custom_loop_example_trains():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "custom_loop.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0]
    assert "global batch 128 = micro 32 x 1 ranks x 4 accum; skipped steps: 0" in proc.stdout
