"""Statistics for side-by-side benchmarks: paired ratios and their bootstrap interval."""

from __future__ import annotations

import random
import statistics

__all__ = ["bootstrap_ci", "paired_ratios"]


def bootstrap_ci(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """90% percentile-bootstrap interval of the median."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


def paired_ratios(a: list[list[float]], b: list[list[float]]) -> dict:
    """Per round, median(a) / median(b); their median and its 90% interval over rounds."""
    paired = [statistics.median(x) / statistics.median(y) for x, y in zip(a, b, strict=True)]
    return {"median": statistics.median(paired), "ci90": bootstrap_ci(paired), "per_round": paired}
