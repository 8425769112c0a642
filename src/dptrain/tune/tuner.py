"""``dptrain tune``: the configuration chosen for the job, by the calibrated simulator and a few short real runs.

Given the user's run config (a built-in task or their own model and data), a global
batch and the machine (:mod:`dptrain.tune.machine`):

1. the space (:func:`~dptrain.tune.space.candidates`) at that global batch;
2. each candidate's memory per rank from the planner (``dptrain plan``'s numbers), the
   ones over ``budget_bytes`` dropped;
3. its step time from the simulator (:func:`~dptrain.planner.simulate.simulate_step`)
   on the calibrated links and overheads (:mod:`dptrain.tune.calibrate`, measured once
   and reused) with the model's compute timed on all ranks at once for each micro-batch;
4. :func:`~dptrain.tune.search.search`: the best few measured by short real runs
   (:func:`~dptrain.tune.trials.run_trial`), or every one (``exhaustive``).

Candidates that meet every few steps (:func:`~dptrain.tune.space.apart`: local SGD,
DiLoCo) are predicted by :func:`~dptrain.planner.periodic.simulate_periodic` and each
measured, apart (``SearchResult.apart``), and never chosen: their loss differs. Their
trial skips the schedule's synchronous warm-up too, and runs at least two rounds of sync
points after it, whole; their step time is the mean over those rounds (a median would
leave the sync points out). Their memory is not planned (the planner models the
synchronous engines): the trial's peak is reported.

Everything it writes goes to the tune directory: the calibration, the profiles, each
trial's config and run directory, the table (``tune.json``, ``tune.md``) and the
winner's config (``best.toml``), which ``dptrain run --config`` takes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dptrain.config import load_config
from dptrain.planner.calibration import Calibration
from dptrain.planner.from_config import plan_config, planned_precision, setup_for
from dptrain.planner.periodic import simulate_periodic
from dptrain.planner.simulate import ComputeProfile, simulate_step
from dptrain.planner.target import plan_target
from dptrain.strategies import get_strategy
from dptrain.tune.calibrate import measure_profiles
from dptrain.tune.machine import Machine
from dptrain.tune.search import Row, SearchResult, search
from dptrain.tune.space import CODEC_RATIO, Candidate, apart
from dptrain.tune.trials import run_trial, write_config

__all__ = ["TuneOptions", "Tuned", "tune", "CODEC_RATIO", "trial_steps"]

@dataclass
class TuneOptions:
    trials: int = 3
    rounds: int = 1
    exhaustive: bool = False
    steps: int = 12
    warmup: int = 4
    timeout: float = 600.0
    budget_bytes: int | None = None
    max_rounds: int | None = None  # the stopping rule's budget (search()); None: 3 or rounds if more (exhaustive: rounds)

    def __post_init__(self) -> None:
        """Each value named by its ``dptrain tune`` option, so bad ones stop it before anything runs (docs/tune.md)."""
        if self.trials < 1:
            raise ValueError(f"--trials must be at least 1 (the candidates measured by real runs), got {self.trials}; "
                             "e.g. --trials 3")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1 (runs of each measured candidate), got {self.rounds}; "
                             "e.g. --rounds 1")
        if self.max_rounds is None:  # an exhaustive search is the reference: each candidate measured `rounds` times
            self.max_rounds = self.rounds if self.exhaustive else max(3, self.rounds)
        if self.max_rounds < self.rounds:
            raise ValueError(f"--max-rounds ({self.max_rounds}) must be at least --rounds ({self.rounds}): the "
                             "stopping rule adds runs to those; e.g. --max-rounds 3")
        if self.steps <= self.warmup or self.warmup < 0:
            raise ValueError(f"--steps ({self.steps}) must exceed --warmup ({self.warmup}), which must be >= 0; "
                             "e.g. --steps 12 --warmup 4")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"--trial-timeout must be a positive number of seconds, got {self.timeout:g}; e.g. "
                             "--trial-timeout 600")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"the memory budget must be positive, got {self.budget_bytes} bytes")


@dataclass
class Tuned:
    result: SearchResult[Candidate]
    profiles: dict[int, ComputeProfile]
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase


def predictor(config: Path | None, overrides: list[str], world_size: int, calibration: Calibration,
              profiles: dict[int, ComputeProfile]) -> Callable[[Candidate], float]:
    """The calibrated simulator's step time for a candidate, in seconds."""
    model = plan_target(load_config(config, overrides)).model
    network = calibration.network()

    def predict(c: Candidate) -> float:
        cfg = load_config(config, [*overrides, *c.overrides()])
        schedule = get_strategy(c.strategy).sync_schedule
        if schedule is not None:
            return simulate_periodic(model, c.strategy, schedule(cfg, model), world_size, profiles[c.micro_batch],
                                     network, accum=c.accum, overheads=calibration.overheads).step_s
        setup = setup_for(cfg, model, c.strategy, world_size, planned_precision(cfg))
        return simulate_step(model, setup, profiles[c.micro_batch], network, "native",
                             compression=CODEC_RATIO[c.codec], accum=c.accum, overheads=calibration.overheads).step_s

    return predict


def planned_memory(config: Path | None, overrides: list[str], world_size: int) -> Callable[[Candidate], int | None]:
    """The planner's bytes per rank for a candidate (model states, activations, communication buffers)."""
    cache: dict[tuple, int | None] = {}

    def memory(c: Candidate) -> int | None:
        if apart(c):  # not planned: the trial's peak says
            return None
        key = (c.strategy, c.micro_batch, c.accum, c.bucket_mb, c.shard_size)
        if key not in cache:
            cfg = load_config(config, [*overrides, *c.overrides()])
            rows = plan_config(cfg, [world_size], [c.strategy], [planned_precision(cfg)])
            cache[key] = rows[0].total() if rows else None
        return cache[key]

    return memory


def profile_request(config: Path | None, overrides: list[str], candidates: list[Candidate],
                    work: Path) -> tuple[Path, list[int], Path]:
    """What the tuned model's compute profile needs: its config (written to ``work``/model.toml), the candidates'
    micro-batch sizes, and where the profiles go (``work``/profiles.json). A calibration measured for this tune
    profiles it in its own first job (``calibrate(models=...)``)."""
    return (write_config(work / "model.toml", config, overrides), sorted({c.micro_batch for c in candidates}),
            work / "profiles.json")


def tune(machine: Machine, config: Path | None, overrides: list[str], candidates: list[Candidate],
         calibration: Calibration, work: Path, options: TuneOptions,
         progress: Callable[[Row[Candidate], int, int], None] | None = None,
         profiles: dict[int, ComputeProfile] | None = None) -> Tuned:
    """Search ``candidates`` on ``machine`` (the module's docstring); trials run in ``work``/trials. ``profiles``:
    the model's compute profiles by micro-batch, where the calibration measured them (:func:`profile_request`),
    else a job of their own measures them."""
    for c in candidates:
        get_strategy(c.strategy)
    seconds = {}
    t0 = time.perf_counter()
    if profiles is None:
        profiles = measure_profiles(machine, *profile_request(config, overrides, candidates, work), options.timeout)
    seconds["profile"] = time.perf_counter() - t0
    predict = predictor(config, overrides, machine.world_size, calibration, profiles)
    memory = planned_memory(config, overrides, machine.world_size)
    names = {c: f"{i:02d}-{c.label.replace(' ', '_').replace('/', '-')}" for i, c in enumerate(candidates)}
    runs = dict.fromkeys(candidates, 0)  # each candidate's runs so far: its next run directory's number

    def measure(c: Candidate):
        trial_dir, runs[c] = work / "trials" / f"{names[c]}-r{runs[c]}", runs[c] + 1
        steps, warmup = trial_steps(config, [*overrides, *c.overrides()], c, options)
        return run_trial(machine, config, [*overrides, *c.overrides()], trial_dir, steps, warmup, options.timeout,
                         mean=apart(c))

    t0 = time.perf_counter()
    result = search([c for c in candidates if not apart(c)], predict, measure, memory, options.budget_bytes,
                    options.trials, options.rounds, options.exhaustive, progress, options.max_rounds)
    others = [c for c in candidates if apart(c)]
    if others:  # each predicted and measured, never chosen
        result.apart = search(others, predict, measure, memory, None, 1, options.rounds, True, progress).rows
        result.trials += len(others)
    seconds["search"] = time.perf_counter() - t0
    return Tuned(result, profiles, seconds)


def trial_steps(config: Path | None, overrides: list[str], c: Candidate, options: TuneOptions) -> tuple[int, int]:
    """A trial's steps and the warm-up its time leaves out: ``options``' for a synchronous candidate; for one that
    meets every few steps, its own warm-up beside theirs, then whole rounds of its sync points, at least two and at
    least ``options``' measured steps."""
    if not apart(c):
        return options.steps, options.warmup
    cfg = load_config(config, overrides)
    schedule = get_strategy(c.strategy).sync_schedule(cfg, plan_target(cfg).model)
    warmup = options.warmup + schedule.warmup_steps
    round_steps = schedule.every * len(schedule.parts)
    rounds = max(2, -(-(options.steps - options.warmup) // round_steps))
    return warmup + rounds * round_steps, warmup
