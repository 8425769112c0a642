"""The papercuts a new user hits first (issue 26): help that does not import torch, benchmarks
with their own --help, plan and simulate headers, samples/s for non-token tasks, the loss plot."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dptrain

_NO_TORCH = """
import sys
from dptrain.cli import main
try:
    main({args!r}, prog_name="dptrain")
except SystemExit as e:
    assert e.code in (0, None), e.code
assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'dptrain')))
"""


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["plan", "--help"], ["simulate", "--help"],
                                  ["bench", "--help"], ["explore", "--help"], ["prepare-data", "--help"]])
def test_help_does_not_import_torch(args):
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH.format(args=args)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: dptrain" in proc.stdout


def test_every_exported_name_still_imports_from_the_package():
    for name in dptrain.__all__:
        assert getattr(dptrain, name) is not None, name
    from dptrain import DDP, DistributedDataParallel

    assert DDP is DistributedDataParallel
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dptrain.nope  # noqa: B018
