"""How long a calibration's probes run (:mod:`dptrain.tune.calibrate`): steps, warm-up, rounds and the re-run rule.

Torch-free, so that ``dptrain tune --help`` states these defaults and the command line refuses a bad
``--probe-steps`` or ``--probe-rounds`` before it imports torch.
"""

from __future__ import annotations

__all__ = ["PROBE_STEPS", "PROBE_WARMUP", "PROBE_ROUNDS", "PROBE_SPREAD", "PROBE_EXTRA"]

# A probe's run: PROBE_STEPS steps, the first PROBE_WARMUP not timed, PROBE_ROUNDS runs of each probe (interleaved).
# Cut from 12 steps (4 warm-up) and 2 rounds, which took 336-2060 s on the emulated cluster, after the calibrations'
# own probe runs cut short predicted the exhaustive searches as well (docs/tune.md, the seventh pass).
PROBE_STEPS, PROBE_WARMUP, PROBE_ROUNDS = 6, 2, 1
PROBE_SPREAD = 0.05  # a probe whose runs' median absolute deviation exceeds this share of their median runs again,
PROBE_EXTRA = 2  # at most this many more times
