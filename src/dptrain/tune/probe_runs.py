"""Several short training runs one after another in one job: the calibration's probes without a launch each.

A probe is a short ``dptrain run`` whose steady step time is all that is read
(:func:`~dptrain.tune.trials.read_steps`). Launched one job each, the launch costs more
than the steps: starting the ranks, importing torch and joining the process group took
2.1 s of a 4.5 s probe on 2 local ranks and 6.3 s of 12.9 on the emulated 4-rank cluster
(the third study's calibrations, ``docs/tune.md``). So a round of probes is one job: each
rank joins the job's store once, then runs each probe's config in the order given with
the runner's own loop (:func:`dptrain.runner.loop.train`, as ``python -m dptrain.run``
does: each run its own engine, run directory and heartbeat), and the step times are read
from each run's ``metrics.jsonl`` as a trial's are. Each run has a process group of its
own (the store prefixed anew), destroyed with every group the run made, and its engine
and buffers collected, before the next begins; rank 0 holds each run's directory while
it runs, as ``python -m dptrain.run`` does. One default group kept across the runs timed
some probes up to 13.5% faster than jobs of their own, in which every connection is new
(``docs/repro/probe_runs_compare.py`` times the two ways against each other, alternated;
``docs/tune.md``).

The tuner's *trials* still run one job each: they measure exactly what a user's run
would be.

    torchrun ... -m dptrain.tune.probe_runs PLAN.json   # [{"config": FILE, "run_dir": DIR}, ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dptrain.allocator import tune_cpu_allocator
from dptrain.batching import BatchSizeError
from dptrain.config import ConfigError, load_config
from dptrain.launch.rendezvous import detect_worker_env, init_distributed, join_store, leave_process_groups
from dptrain.launch.run_lock import RunDirError, acquire
from dptrain.launch.threads import omp_threads, threads_per_worker
from dptrain.pages.plots import read_metrics
from dptrain.runner.validate import validate_run
from dptrain.tune.machine import JOB_ERRORS, Machine, where_kept
from dptrain.tune.search import Measured, TrialFailed
from dptrain.tune.trials import prune, read_steps, trial_overrides, write_config
from dptrain.utils.atomic import write_text_atomic
from dptrain.utils.collector import freeze_imports
from dptrain.utils.files import UnsafePath
from dptrain.utils.worker_exit import exit_worker

__all__ = ["run_probes", "main"]


def run_probes(machine: Machine, probes: list[tuple[Path, Path | None, list[str]]], steps: int, warmup: int,
               timeout: float) -> list[Measured]:
    """Each probe ``(trial directory, base config, overrides)`` run for ``steps`` steps, in order, in one job on
    ``machine``; what each measured (:func:`~dptrain.tune.trials.read_steps` after ``warmup``).

    The job is given ``timeout`` per probe, all together (a probe that hangs is ended sooner by its own
    collective timeout and watchdog, ``distributed.timeout_s``). A job that fails is a
    :class:`~dptrain.tune.search.TrialFailed` naming the first probe that did not log its last step."""
    if steps <= warmup:
        raise ValueError(f"a probe needs more steps ({steps}) than warm-up steps ({warmup})")
    plan = []
    for trial_dir, config, overrides in probes:
        toml = write_config(trial_dir / "config.toml", config, [*overrides, *trial_overrides(steps)])
        plan.append({"config": str(toml), "run_dir": str(trial_dir / "run")})
    if not plan:
        return []
    plan_file = probes[0][0].parent / f"{probes[0][0].name}.plan.json"  # beside the runs: what the job ran
    write_text_atomic(plan_file, json.dumps(plan, indent=1))
    errors = plan_file.with_name(f"{probes[0][0].name}.{JOB_ERRORS}")
    code, tail = machine.job(["-m", "dptrain.tune.probe_runs", str(plan_file)], timeout * len(plan), errors=errors)
    if code != 0:
        stopped = next((p["run_dir"] for p in plan if not _finished(Path(p["run_dir"]), steps)), "?")
        if code == 124:
            why = f"hung: not finished after {timeout * len(plan):g} s ({timeout:g} s for each of {len(plan)}), stopped"
        else:
            why = f"exit {code}: {tail.splitlines()[-1] if tail else 'see that run directory'}"
        for p in plan:  # the runs it finished, as measured ones: their weights and checkpoints are of no use
            if _finished(Path(p["run_dir"]), steps):
                prune(Path(p["run_dir"]))
        raise TrialFailed(f"the probe job stopped in {stopped}: {why}{where_kept(errors)}")
    measured = []
    for p in plan:
        measured.append(read_steps(Path(p["run_dir"]), warmup))
        prune(Path(p["run_dir"]))
    return measured


def _finished(run_dir: Path, steps: int) -> bool:
    """Whether a probe's run logged its last step (a torn last line is not one)."""
    try:
        records, _ = read_metrics(run_dir / "metrics.jsonl")
    except OSError:
        return False
    logged = [r["step"] for r in records if r.get("kind") == "train"]
    return bool(logged) and logged[-1] == steps


def main(argv: list[str] | None = None) -> int:
    """One rank of a probe job: every run of PLAN.json in order, each in a process group of its own.

    Exit codes as ``python -m dptrain.run``'s: 2 for a plan or config that cannot run (said once, by rank 0)
    or a run directory another run holds, 1 for anything else."""
    parser = argparse.ArgumentParser(prog="python -m dptrain.tune.probe_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", help="JSON: [{\"config\": FILE, \"run_dir\": DIR}, ...]")
    args = parser.parse_args(argv)
    env = detect_worker_env()
    try:
        plans = _read_plan(Path(args.plan), env.world_size)
    except _BAD_PLAN as e:
        if env.rank == 0:
            print(f"error: {args.plan}: {e}", file=sys.stderr)
        return 2
    from dptrain.runner.loop import train  # after the input checks, as dptrain.run does

    if omp_threads(os.environ) is None:
        torch.set_num_threads(threads_per_worker(env.local_world_size))
    if not torch.cuda.is_available():
        tune_cpu_allocator()
    backend = plans[0].cfg.distributed.backend
    timeout_s = max(rp.cfg.distributed.timeout_s for rp in plans)
    store = join_store(env, timedelta(seconds=timeout_s))
    for i, rp in enumerate(plans):  # each run its own process group: new connections, as in a job of its own
        device = init_distributed(env, backend, rp.cfg.distributed.timeout_s, store=dist.PrefixStore(f"probe{i}", store))
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)  # each probe's peak its own
            with _holding(rp.run_dir, env.rank):
                train(rp, env, device)
        except RunDirError as e:
            if env.rank == 0:
                print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            leave_process_groups()  # every group the run made, its engine and buffers, before the next is timed
    return 0


_BAD_PLAN = (ConfigError, BatchSizeError, UnsafePath, OSError, ValueError, KeyError, TypeError)  # JSON's errors too


def _read_plan(path: Path, world_size: int) -> list:
    """The checked plan of each run of a probe job's PLAN.json; one of ``_BAD_PLAN`` where it cannot run."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError("a probe job's plan is a non-empty JSON list of {\"config\": FILE, \"run_dir\": DIR}")
    plans = []
    for p in entries:
        cfg = load_config(p["config"], [f"run_dir={json.dumps(str(p['run_dir']))}"])
        plans.append(validate_run(cfg, world_size, check_forward=False))
    backends = {rp.cfg.distributed.backend for rp in plans}
    if len(backends) > 1:
        raise ValueError(f"the probes of one job must share a backend, got {sorted(backends)}")
    return plans


@contextlib.contextmanager
def _holding(run_dir: Path, rank: int) -> Iterator[None]:
    """Rank 0 holds ``run_dir``'s lock while the run writes it (``launch.run_lock``); every rank learns at once
    whether it could (one broadcast), so a directory in use is a :class:`RunDirError` on every rank, not a hang."""
    lock, message = None, ""
    if rank == 0:
        try:
            lock = acquire(run_dir, "python -m dptrain.tune.probe_runs (rank 0)", environ={})
        except RunDirError as e:
            message = str(e)
    box = [message]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise RunDirError(box[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    freeze_imports()  # this worker's exit walks none of torch's objects (dptrain.utils.collector)
    exit_worker(main())  # its end short of the interpreter's teardown (dptrain.utils.worker_exit)
