"""What ``dptrain tune`` writes: the table of every candidate, the winner's config and its command line."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from dptrain.planner.calibration import Calibration
from dptrain.tune.machine import Emulated, Launcher, Local, Machine
from dptrain.tune.search import Row
from dptrain.tune.space import Candidate
from dptrain.tune.trials import write_config
from dptrain.tune.tuner import Tuned
from dptrain.utils.atomic import write_text_atomic

__all__ = ["table", "tables", "to_json", "write_outputs", "command"]


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def table(rows: list[Row[Candidate]], best: Row[Candidate] | None) -> str:
    """Markdown: every candidate in predicted order, with its memory, predicted and measured step (the median of its
    runs, their count and spread: (max - min) / median) and status."""
    lines = ["| # | candidate | planned MiB/rank | predicted ms | measured ms (median) | runs | spread | "
             "predicted / measured | peak MiB (run) | status |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rows, 1):
        ratio = f"{r.predicted_s / r.measured_s:.2f}" if r.predicted_s and r.measured_s else "-"
        peak = "-" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        spread = "-" if r.spread is None else f"{100 * r.spread:.1f}%"
        mark = " **best**" if r is best else ""
        lines.append(f"| {i} | {r.candidate.label}{mark} | {_mib(r.memory_bytes)} | {_ms(r.predicted_s)} | "
                     f"{_ms(r.measured_s)} | {len(r.measured)} | {spread} | {ratio} | {peak} | {r.status} |")
    return "\n".join(lines)


def tables(result) -> str:
    """Markdown: :func:`table` of the candidates ranked; below it, where the search had them, those measured apart
    (strategies that meet every few steps: never chosen, their loss differs)."""
    text = table(result.rows, result.best)
    if result.apart:
        text += ("\n\nMeasured apart, never chosen: these strategies' replicas step alone and meet every few steps, "
                 "so their loss after a step is not synchronous training's (docs/localsgd.md); the step time "
                 "is the mean over whole rounds of their sync points.\n\n" + table(result.apart, None))
    return text


def _rows(rows: list[Row[Candidate]]) -> list[dict]:
    return [{"candidate": r.candidate.label, "overrides": r.candidate.overrides(), "memory_bytes": r.memory_bytes,
             "predicted_s": r.predicted_s, "measured_s": r.measured_s, "measured_runs_s": [m.step_s for m in r.measured],
             "spread": r.spread, "peak_mb": r.peak_mb, "status": r.status} for r in rows]


def to_json(tuned: Tuned, machine: Machine, calibration: Calibration, options: dict) -> dict:
    res = tuned.result
    return {"options": options, "where": machine.where, "world_size": machine.world_size, "trials": res.trials,
            "seconds": tuned.seconds, "calibration": calibration.to_dict(),
            "best": None if res.best is None else res.best.candidate.label,
            "predicted_best": None if res.predicted_best is None else res.predicted_best.candidate.label,
            "rows": _rows(res.rows), "apart": _rows(res.apart)}


def command(machine: Machine, config: Path, strategy: str) -> str:
    """The command that runs ``config`` (which holds ``strategy``) on ``machine``; ``dptrain run`` names the strategy
    on its command line too, where a reader sees it."""
    if isinstance(machine, Local):
        return f"dptrain run --nproc {machine.per_host} --strategy {strategy} --config {shlex.quote(str(config))}"
    if isinstance(machine, Emulated):
        return (f"dptrain cluster --hosts {machine.hosts} --per-host {machine.per_host} --bandwidth-gbit "
                f"{machine.rate_gbit:g} -- -m dptrain.run --config {shlex.quote(str(config))}")
    if isinstance(machine, Launcher):
        return f"{machine.command} -m dptrain.run --config {shlex.quote(str(config))}"
    raise TypeError(f"no command for {type(machine).__name__}")


def write_outputs(tuned: Tuned, machine: Machine, calibration: Calibration, config: Path | None,
                  overrides: list[str], out: Path, options: dict) -> Path | None:
    """``tune.json``, ``tune.md`` and, when a candidate was measured, ``best.toml``; returns the latter."""
    best = tuned.result.best
    write_text_atomic(out / "tune.json", json.dumps(to_json(tuned, machine, calibration, options), indent=1) + "\n")
    write_text_atomic(out / "tune.md", tables(tuned.result) + "\n")
    if best is None:
        return None
    return write_config(out / "best.toml", config, [*overrides, *best.candidate.overrides()])
