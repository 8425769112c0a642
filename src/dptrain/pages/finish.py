"""A finished run's pages, written by whoever ran the loop, from the run directory's files.

The training loop (:mod:`dptrain.runner.loop`, or the parameter server's) writes
``metrics.jsonl``, ``trace.json`` and the weights, and returns the run's facts; it draws
nothing. Then, on rank 0, :func:`write_run_pages` draws the plots (``log.plots``), writes
``summary.json`` (whose file listing includes the plots) and ``report.html``, and returns the
summary for the console (:func:`dptrain.runner.report.print_summary`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.pages.plots import plot_run, read_metrics
from dptrain.pages.run_report import try_write_run_report
from dptrain.runner.facts import RunFacts
from dptrain.runner.report import summarize

__all__ = ["write_run_pages", "plot_title"]


def write_run_pages(run_dir: Path, facts: RunFacts, cfg, log: Callable[[str], None]) -> dict[str, Any]:
    """Plots, ``summary.json`` and ``report.html`` of the run in ``run_dir``; returns the summary.

    ``facts``: what the loop returned (task, ranks, batch, steps, wall time...); ``cfg``: the run's
    resolved config; ``log``: where to say where the report went, or why it was not written (a
    report that fails is a warning, never a failed run).
    """
    run_dir = Path(run_dir)
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    if cfg.log.plots:
        plot_run(run_dir, title=plot_title(facts))
    summary = summarize(run_dir, facts, train, evals)
    if cfg.log.plots:  # after the summary, which it shows
        try_write_run_report(run_dir, summary, cfg, log)
        if (run_dir / "report.html").exists():  # listed as summary.json is: printed, not inside summary.json
            summary["files"]["report.html"] = (run_dir / "report.html").stat().st_size
    return summary


def plot_title(facts: RunFacts) -> str:
    """The plots' title: the task, and how the ranks were used (the ranks and the global batch, or the strategy's
    own description of its layout)."""
    if facts.layout:
        return f"{facts.task}, {facts.layout}"
    return f"{facts.task} on {facts.world_size} rank(s), global batch {facts.global_batch_size}"
