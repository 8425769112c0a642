"""One short real run of a configuration: ``python -m dptrain.run`` on the machine's ranks, its step time read back.

The run's config is the user's with the candidate's overrides and the trial's own
settings on top (``steps`` steps, no checkpoints, no evaluation, no plots, a log line
every step), written as TOML into the trial's directory and run there. The step time is
the median of the slowest rank's ``step_ms`` (``metrics.jsonl``) over the steps after
``warmup``; the memory is the largest peak of live tensors over the ranks (or, where the
run did not measure it, of the resident set). A run that exits non-zero or runs past
its timeout is a :class:`~dptrain.tune.search.TrialFailed` naming why (its run directory
is kept whole); a measured trial's weights and checkpoint are removed (:func:`prune`).
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

from dptrain.config import load_config, to_toml
from dptrain.pages.plots import read_metrics
from dptrain.tune.machine import JOB_ERRORS, Machine, where_kept
from dptrain.tune.search import Measured, TrialFailed
from dptrain.utils.atomic import write_text_atomic

__all__ = ["trial_overrides", "write_config", "run_trial", "read_steps", "prune"]


def trial_overrides(steps: int) -> list[str]:
    """What a trial sets beyond the candidate: its length, and nothing that is not a training step. The one
    evaluation a run makes at its end reads one batch, not the default eight, which saved about 11 s of a 185 s
    round of calibration probes on the emulated 4 x 1 cluster at 1 Gbit/s."""
    return [f"train.steps={steps}", "checkpoint.every=0", "log.every=1", "log.eval_every=0", "log.eval_batches=1",
            "log.plots=false", "log.trace_steps=0"]


def write_config(path: Path, config: Path | None, overrides: list[str]) -> Path:
    """The run config ``config`` with ``overrides``, resolved and written as TOML to ``path``."""
    cfg = load_config(config, overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, to_toml(cfg))
    return path


def read_steps(run_dir: Path, warmup: int, mean: bool = False) -> Measured:
    """The median step time after ``warmup`` steps (``mean``: their mean, for a strategy whose sync points fall on a
    few of them), the peak memory and the steps' spread, from a finished run's ``metrics.jsonl``."""
    records, _ = read_metrics(run_dir / "metrics.jsonl")  # a torn last line is left out
    train = [r for r in records if r.get("kind") == "train" and r["step"] > warmup]
    if not train:
        raise TrialFailed(f"no step after the {warmup} warm-up steps was logged in {run_dir / 'metrics.jsonl'}")
    peaks = [m for r in train for m in (r.get("peak_tensor_mb") or []) if m is not None]
    if not peaks:
        peaks = [m for r in train for m in (r.get("peak_rss_mb") or []) if m is not None]
    times = [r["step_ms"] for r in train]
    middle = statistics.median(times)
    spread = statistics.median(abs(t - middle) for t in times) / middle if middle > 0 else 0.0
    return Measured((statistics.fmean(times) if mean else middle) / 1e3, max(peaks) if peaks else None, spread)


def run_trial(machine: Machine, config: Path | None, overrides: list[str], trial_dir: Path, steps: int,
              warmup: int, timeout: float, mean: bool = False) -> Measured:
    """Run the configuration for ``steps`` steps in ``trial_dir`` (a new directory); its :class:`Measured`
    (:func:`read_steps`)."""
    if steps <= warmup:
        raise ValueError(f"a trial needs more steps ({steps}) than warm-up steps ({warmup})")
    toml = write_config(trial_dir / "config.toml", config, [*overrides, *trial_overrides(steps)])
    errors = trial_dir / JOB_ERRORS
    code, tail = machine.job(["-m", "dptrain.run", "--config", str(toml), "--run-dir", str(trial_dir / "run")],
                             timeout, errors=errors)
    if code == 124:
        raise TrialFailed(f"hung: not finished after {timeout:g} s, stopped{where_kept(errors)}")
    if code != 0:
        why = tail.splitlines()[-1] if tail else f"see {trial_dir / 'run'}"
        if "out of memory" in tail.lower() or code == -9 or code == 137:
            why = f"out of memory? {why}"
        raise TrialFailed(f"exit {code}: {why}{where_kept(errors)}")
    measured = read_steps(trial_dir / "run", warmup, mean)
    prune(trial_dir / "run")
    return measured


def prune(run_dir: Path) -> None:
    """A measured trial's weights and checkpoint removed (tens of MB each, of no use): its config, metrics, summary
    and logs stay. Only what the trial's own run wrote inside the tune directory is removed, links not followed."""
    for name in ("model.safetensors", "checkpoints"):
        path = run_dir / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
