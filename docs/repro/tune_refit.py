"""The overheads refitted by today's simulator to an earlier calibration's probe runs (docs/tune.md).

    python docs/repro/tune_refit.py TUNE_DIR OUT.json

Reads TUNE_DIR/calibration.json (any version) and the compute profiles under TUNE_DIR/calibration/, recomputes every
probe's timeline and features, fits the terms again and writes a calibration of today's version to OUT.json (score an
exhaustive search against it with docs/repro/tune_rescore.py). Nothing is measured again.
"""

import sys
import tempfile
from pathlib import Path

from dptrain.tune.calibrate import refit

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        refit(Path(sys.argv[1]) / "calibration.json", Path(work)).save(Path(sys.argv[2]))
