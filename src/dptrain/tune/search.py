"""The tuner's search: prune what does not fit, rank the rest by predicted step time, measure the best few.

The algorithm (DeepSpeed's autotuner measures a grid; this one measures only what the
calibrated simulator ranks first):

1. every candidate's planned memory per rank is compared with the budget; those over it
   are dropped (``does not fit``), never run;
2. the rest are ranked by the simulator's predicted step time (a candidate the
   simulator cannot predict ranks last, with the reason);
3. the first ``trials`` are measured with short real runs, ``rounds`` times each,
   interleaved (round r starts at the r-th candidate, so no candidate always runs first
   or last); a trial that fails (out of memory, a crash, a hang) is recorded with its
   reason and the next candidate in the ranking takes its place, until ``trials``
   candidates were measured or ``2 * trials`` were tried;
4. **until the best is told apart** (a stopping rule within a budget): while the best
   measured candidate cannot be told from another (their medians differ by no more than
   their runs' median absolute deviations added; a candidate run once has none yet, so
   it cannot), those candidates run once more each, interleaved, up to ``max_rounds``
   runs in all: on a machine whose steps vary 3-6% between runs, one run each cannot
   separate candidates closer than that (docs/tune.md);
5. the winner is the measured candidate with the lowest median step time; each row
   reports its runs' spread (:attr:`Row.spread`, the range over the median).

``exhaustive=True`` measures every candidate that fits: the reference the tuner is
checked against. Only the callables touch the machine, so the search is tested on fake
ones (tests/test_tune_search.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Measured", "TrialFailed", "Row", "SearchResult", "search"]

C = TypeVar("C", bound=Hashable)


@dataclass(frozen=True)
class Measured:
    """One real run of a candidate: its median step time after the warm-up, its peak memory per rank, and how much
    its timed steps varied (their median absolute deviation over their median)."""

    step_s: float
    peak_mb: float | None = None
    spread: float = 0.0


class TrialFailed(RuntimeError):
    """A trial that did not give a step time: its run crashed, ran out of memory or hung (the message says which)."""


@dataclass
class Row(Generic[C]):
    """One candidate's line in the tuner's table."""

    candidate: C
    memory_bytes: int | None = None
    predicted_s: float | None = None
    status: str = "ranked"  # ranked, does not fit, not predicted: ..., measured, failed: ...
    measured: list[Measured] = field(default_factory=list)

    @property
    def measured_s(self) -> float | None:
        return statistics.median(m.step_s for m in self.measured) if self.measured else None

    @property
    def spread(self) -> float | None:
        """The range of its runs over their median ((max - min) / median); None below two runs."""
        if len(self.measured) < 2:
            return None
        times = [m.step_s for m in self.measured]
        return (max(times) - min(times)) / statistics.median(times)

    @property
    def deviation(self) -> float | None:
        """The median absolute deviation of its runs from their median (seconds); None below two runs. Unlike the
        range it does not widen as runs are added, so more runs can tell two candidates apart."""
        if len(self.measured) < 2:
            return None
        median = self.measured_s
        return statistics.median(abs(m.step_s - median) for m in self.measured)

    def overlaps(self, other: Row) -> bool:
        """Whether it cannot be told from ``other``: their medians differ by no more than their deviations added, or
        either ran once (no deviation yet)."""
        if self.deviation is None or other.deviation is None:
            return True
        return abs(self.measured_s - other.measured_s) <= self.deviation + other.deviation

    @property
    def peak_mb(self) -> float | None:
        peaks = [m.peak_mb for m in self.measured if m.peak_mb is not None]
        return max(peaks) if peaks else None


@dataclass
class SearchResult(Generic[C]):
    rows: list[Row[C]]  # in predicted order: ranked ones first, then not predicted, then those that do not fit
    best: Row[C] | None
    trials: int  # candidates run for real (failed ones included)
    apart: list[Row[C]] = field(default_factory=list)  # predicted and measured, never chosen (their loss differs)

    @property
    def predicted_best(self) -> Row[C] | None:
        ranked = [r for r in self.rows if r.predicted_s is not None and r.status != "does not fit"]
        return ranked[0] if ranked else None


def search(candidates: list[C], predict: Callable[[C], float], measure: Callable[[C], Measured],
           memory: Callable[[C], int | None] | None = None, budget_bytes: int | None = None, trials: int = 3,
           rounds: int = 1, exhaustive: bool = False,
           progress: Callable[[Row[C], int, int], None] | None = None,
           max_rounds: int | None = None) -> SearchResult[C]:
    """Search ``candidates`` (see the module's docstring); ``progress(row, done, total)`` after each run.

    ``predict`` and ``memory`` may raise ValueError (or any Exception) for a candidate they cannot
    handle: the row says why and the search goes on. ``measure`` raises :class:`TrialFailed`, or
    any other Exception, for a trial that failed. ``max_rounds`` (default ``rounds``: no
    stopping rule): the most runs of a candidate the stopping rule may spend.
    """
    max_rounds = rounds if max_rounds is None else max_rounds
    if trials < 1 or rounds < 1 or max_rounds < rounds:
        raise ValueError(f"trials and rounds must be at least 1 and max_rounds at least rounds, got {trials}, "
                         f"{rounds} and {max_rounds}")
    if len(set(candidates)) != len(candidates):
        raise ValueError("the candidates repeat one another")
    rows = [Row(c) for c in candidates]
    for row in rows:
        if memory is not None:
            try:
                row.memory_bytes = memory(row.candidate)
            except Exception as e:  # noqa: BLE001 - the row says why
                row.status = f"memory not planned: {e}"
        if budget_bytes is not None and row.memory_bytes is not None and row.memory_bytes > budget_bytes:
            row.status = "does not fit"
            continue
        try:
            row.predicted_s = predict(row.candidate)
        except Exception as e:  # noqa: BLE001
            row.status = f"not predicted: {e}"
    fits = [r for r in rows if r.status != "does not fit"]
    order = sorted(fits, key=lambda r: (r.predicted_s is None, r.predicted_s or 0.0))
    rows = order + [r for r in rows if r.status == "does not fit"]
    if exhaustive:
        to_run, limit, want = list(order), len(order), len(order)
    else:
        to_run, limit, want = order[:trials], min(len(order), 2 * trials), trials
    queue = order[len(to_run):]
    tried: list[Row[C]] = []
    total = len(to_run) * rounds
    done = 0

    def run(row: Row[C]) -> None:
        nonlocal done
        if not row.status.startswith("failed"):  # a candidate that failed is not run again
            try:
                row.measured.append(measure(row.candidate))
                row.status = "measured"
            except Exception as e:  # noqa: BLE001 - a failed trial is a row of the table, not the end
                row.status = f"failed: {e}"
                row.measured.clear()
        done += 1
        if progress is not None:
            progress(row, done, total)

    while to_run:
        batch, to_run = to_run, []
        for r in range(rounds):
            for row in batch[r % len(batch):] + batch[:r % len(batch)]:
                run(row)
        tried += batch
        measured = sum(r.status == "measured" for r in tried)
        while queue and len(tried) + len(to_run) < limit and measured + len(to_run) < want:
            to_run.append(queue.pop(0))
        total += len(to_run) * rounds
    for r in range(rounds, max_rounds):  # the stopping rule: until the best's runs stand apart from every other's
        ok = [row for row in tried if row.status == "measured"]
        if not ok:
            break
        best = min(ok, key=lambda row: row.measured_s)
        contenders = [best] + [row for row in ok if row is not best and row.overlaps(best)]
        if len(contenders) < 2:
            break
        total += len(contenders)
        for row in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            run(row)
    ok = [r for r in tried if r.status == "measured"]
    best = min(ok, key=lambda r: r.measured_s) if ok else None
    return SearchResult(rows, best, len(tried))
