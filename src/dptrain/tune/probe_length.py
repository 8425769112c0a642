"""How long a calibration's probes run (:mod:`dptrain.tune.calibrate`): steps, warm-up, rounds and the re-run rule.

Torch-free, so that ``dptrain tune --help`` states these defaults and the command line refuses a bad
``--probe-steps`` or ``--probe-rounds`` before it imports torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from dptrain.tune.search import Measured

__all__ = ["PROBE_STEPS", "PROBE_WARMUP", "PROBE_ROUNDS", "PROBE_SPREAD", "PROBE_EXTRA", "unsettled"]

# A probe's run: PROBE_STEPS steps, the first PROBE_WARMUP not timed, PROBE_ROUNDS runs of each probe (interleaved).
# Cut from 12 steps (4 warm-up) and 2 rounds, which took 336-2060 s on the emulated cluster, after the calibrations'
# own probe runs cut short predicted the exhaustive searches as well (docs/tune.md, the seventh pass).
PROBE_STEPS, PROBE_WARMUP, PROBE_ROUNDS = 6, 2, 1
PROBE_SPREAD = 0.05  # a probe whose runs' median absolute deviation exceeds this share of their median runs again,
PROBE_EXTRA = 2  # at most this many more times


def unsettled(runs: Sequence[Measured], rounds: int) -> bool:
    """Whether a probe runs again, while it has had fewer than ``rounds + PROBE_EXTRA`` runs: of one run, where its
    timed steps' median absolute deviation exceeds ``PROBE_SPREAD`` of their median (a job beside it, or a step of
    its own disturbed); of several, where their step times' deviation does (two runs more than 10% apart). One
    disturbed run of two moves their median halfway (runs of one probe here were 110 and 205 ms while another job ran
    beside them); of three, the median is an undisturbed run's and the deviation drops (a range would not: more runs
    never narrow it)."""
    if len(runs) >= rounds + PROBE_EXTRA:
        return False
    if len(runs) == 1:
        return runs[0].spread > PROBE_SPREAD
    steps = [m.step_s for m in runs]
    middle = statistics.median(steps)
    return statistics.median(abs(x - middle) for x in steps) > PROBE_SPREAD * middle
