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
``docs/tune.md``). A probe whose runs are unsettled (``probe_length.unsettled``) runs again
in the same job, each plan entry naming the directories its next runs may take
(``"again"``): rank 0 judges each pass's runs and tells the others through the job's
store, so a one-round calibration's reruns cost no start of their own (two, about 12 s
each, on the emulated 4-host cluster).

The tuner's *trials* still run one job each: they measure exactly what a user's run
would be.

    torchrun ... -m dptrain.tune.probe_runs PLAN.json
    # [{"config": FILE, "run_dir": DIR, "warmup": N, "again": [{"config": FILE, "run_dir": DIR}, ...]}, ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

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
from dptrain.tune.probe_length import unsettled
from dptrain.tune.search import Measured, TrialFailed
from dptrain.tune.trials import prune, read_steps, trial_overrides, write_config
from dptrain.utils.atomic import write_text_atomic
from dptrain.utils.collector import freeze_imports
from dptrain.utils.files import UnsafePath
from dptrain.utils.worker_exit import exit_worker

__all__ = ["run_probes", "main"]


def run_probes(machine: Machine, probes: list[tuple[Path, Path | None, list[str]]], steps: int, warmup: int,
               timeout: float, again: int = 0) -> list[list[Measured]]:
    """Each probe ``(trial directory, base config, overrides)`` run for ``steps`` steps, in order, in one job on
    ``machine``, and up to ``again`` more times while unsettled (:func:`~dptrain.tune.probe_length.unsettled`,
    judged by rank 0 after each pass and run in the same job, into ``<trial directory>`` with its round ``-r<n>``
    counted on); what each run measured, by probe (:func:`~dptrain.tune.trials.read_steps` after ``warmup``).

    The job is given ``timeout`` per run it may make, all together (a probe that hangs is ended sooner by its own
    collective timeout and watchdog, ``distributed.timeout_s``). A job that fails is a
    :class:`~dptrain.tune.search.TrialFailed` naming the first probe that did not log its last step."""
    if steps <= warmup:
        raise ValueError(f"a probe needs more steps ({steps}) than warm-up steps ({warmup})")
    plan = []
    for trial_dir, config, overrides in probes:
        entry = {"config": str(write_config(trial_dir / "config.toml", config, [*overrides, *trial_overrides(steps)])),
                 "run_dir": str(trial_dir / "run"), "warmup": warmup, "again": []}
        for later in _later(trial_dir, again):
            entry["again"].append({"config": str(write_config(later / "config.toml", config,
                                                              [*overrides, *trial_overrides(steps)])),
                                   "run_dir": str(later / "run")})
        plan.append(entry)
    if not plan:
        return []
    plan_file = probes[0][0].parent / f"{probes[0][0].name}.plan.json"  # beside the runs: what the job ran
    write_text_atomic(plan_file, json.dumps(plan, indent=1))
    errors = plan_file.with_name(f"{probes[0][0].name}.{JOB_ERRORS}")
    limit = timeout * len(plan) * (1 + again)
    code, tail = machine.job(["-m", "dptrain.tune.probe_runs", str(plan_file)], limit, errors=errors)
    ran = [[Path(p["run_dir"])] + [Path(a["run_dir"]) for a in p["again"] if Path(a["run_dir"]).exists()]
           for p in plan]
    if code != 0:
        stopped = next((str(d) for dirs in ran for d in dirs if not _finished(d, steps)), "?")
        if code == 124:
            why = (f"hung: not finished after {limit:g} s ({timeout:g} s for each of the {len(plan) * (1 + again)} "
                   "runs it could make), stopped")
        else:
            why = f"exit {code}: {tail.splitlines()[-1] if tail else 'see that run directory'}"
        for d in (d for dirs in ran for d in dirs if _finished(d, steps)):  # as measured runs: their weights
            prune(d)                                                         # and checkpoints are of no use
        raise TrialFailed(f"the probe job stopped in {stopped}: {why}{where_kept(errors)}")
    measured = []
    for dirs in ran:
        measured.append([read_steps(d, warmup) for d in dirs])
        for d in dirs:
            prune(d)
    return measured


def _later(trial_dir: Path, again: int) -> list[Path]:
    """The directories of a probe's next ``again`` runs: ``<stem>-r<n>`` with n counted on from the trial's."""
    stem, _, r = trial_dir.name.rpartition("-r")
    if again and not (stem and r.isdigit()):
        raise ValueError(f"a probe that may run again needs a directory named <probe>-r<round>, got {trial_dir}")
    return [trial_dir.with_name(f"{stem}-r{int(r) + j}") for j in range(1, again + 1)]


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
    backend = plans[0].first.cfg.distributed.backend
    timeout_s = max(probe.first.cfg.distributed.timeout_s for probe in plans)
    store = join_store(env, timedelta(seconds=timeout_s))
    done: list[list[Path]] = [[] for _ in plans]
    todo, k = list(range(len(plans))), 0
    while todo:  # the plan, then again each probe still unsettled, while it has runs left
        for i in todo:  # each run its own process group: new connections, as in a job of its own
            rp = plans[i].first if k == 0 else plans[i].again[k - 1]
            device = init_distributed(env, backend, rp.cfg.distributed.timeout_s,
                                      store=dist.PrefixStore(f"probe{i}.{k}", store))
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
            done[i].append(rp.run_dir)
        k += 1
        todo = _again(store, env.rank, env.world_size, k, [i for i in todo if k <= len(plans[i].again)], plans, done)
    return 0


def _again(store: dist.Store, rank: int, world_size: int, k: int, candidates: list[int], plans: list[_Probe],
           done: list[list[Path]]) -> list[int]:
    """Which of ``candidates`` run again after pass ``k``: rank 0 reads their runs and judges each
    (:func:`~dptrain.tune.probe_length.unsettled`, one round), every rank learns its answer from the job's store.

    [Note: rank 0 leaves last] Where rank 0's process serves the job's store (torchrun's agents not sharing
    theirs, as under ``dptrain cluster``), rank 0 leaving ends the store: the other ranks' ``get`` of the
    answer, sent but not yet answered, then fails ("Failed to recv, got 0 bytes"). It did so on 2 x 2 at 100
    Mbit/s, where ranks 1-3 finish a pass later than rank 0 (docs/tune.md, the tenth pass). So each rank says
    it has read the answer, and rank 0 waits for every one before it goes on (or ends the job)."""
    if not candidates:
        return []
    if rank == 0:
        chosen = []
        for i in candidates:
            with contextlib.suppress(TrialFailed):  # a run that logged no timed step is read, and failed, by the caller
                if unsettled([read_steps(d, plans[i].warmup) for d in done[i]], 1):
                    chosen.append(i)
        store.set(f"again{k}", json.dumps(chosen))
    answer = json.loads(store.get(f"again{k}"))
    if rank == 0:
        store.wait([f"read{k}/{r}" for r in range(1, world_size)])
    else:
        store.set(f"read{k}/{rank}", b"1")
    return answer


_BAD_PLAN = (ConfigError, BatchSizeError, UnsafePath, OSError, ValueError, KeyError, TypeError)  # JSON's errors too


@dataclass(frozen=True)
class _Probe:
    """One probe of a job's plan: its first run, the runs it may make again, the warm-up its reading leaves out."""

    first: Any
    again: list
    warmup: int


def _read_plan(path: Path, world_size: int) -> list[_Probe]:
    """The checked plan of each probe of a probe job's PLAN.json; one of ``_BAD_PLAN`` where it cannot run."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError("a probe job's plan is a non-empty JSON list of {\"config\": FILE, \"run_dir\": DIR}")

    def checked(p: dict) -> Any:
        cfg = load_config(p["config"], [f"run_dir={json.dumps(str(p['run_dir']))}"])
        return validate_run(cfg, world_size, check_forward=False)

    probes = [_Probe(checked(p), [checked(a) for a in p.get("again", [])], int(p.get("warmup", 0))) for p in entries]
    backends = {rp.cfg.distributed.backend for probe in probes for rp in (probe.first, *probe.again)}
    if len(backends) > 1:
        raise ValueError(f"the probes of one job must share a backend, got {sorted(backends)}")
    return probes


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
