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
and buffers collected, before the next begins: one default group kept across the runs
timed the smallest models' probes up to 13% faster than jobs of their own, in which every
connection is new (``docs/repro/probe_runs_compare.py`` times the two ways against each
other, alternated; ``docs/tune.md``).

The tuner's *trials* still run one job each: they measure exactly what a user's run
would be.

    torchrun ... -m dptrain.tune.probe_runs PLAN.json   # [{"config": FILE, "run_dir": DIR}, ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dptrain.allocator import tune_cpu_allocator
from dptrain.config import load_config
from dptrain.launch.rendezvous import detect_worker_env, init_distributed, join_store, leave_process_groups
from dptrain.launch.threads import omp_threads, threads_per_worker
from dptrain.runner.validate import validate_run
from dptrain.tune.machine import Machine
from dptrain.tune.search import Measured, TrialFailed
from dptrain.tune.trials import prune, read_steps, trial_overrides, write_config
from dptrain.utils.atomic import write_text_atomic

__all__ = ["run_probes", "main"]


def run_probes(machine: Machine, probes: list[tuple[Path, Path | None, list[str]]], steps: int, warmup: int,
               timeout: float) -> list[Measured]:
    """Each probe ``(trial directory, base config, overrides)`` run for ``steps`` steps, in order, in one job on
    ``machine``; what each measured (:func:`~dptrain.tune.trials.read_steps` after ``warmup``). ``timeout`` is per
    probe. A job that fails is a :class:`~dptrain.tune.search.TrialFailed` naming the probe it stopped in."""
    if steps <= warmup:
        raise ValueError(f"a probe needs more steps ({steps}) than warm-up steps ({warmup})")
    plan = []
    for trial_dir, config, overrides in probes:
        toml = write_config(trial_dir / "config.toml", config, [*overrides, *trial_overrides(steps)])
        plan.append({"config": str(toml), "run_dir": str(trial_dir / "run")})
    if not plan:
        return []
    plan_file = probes[0][0].parent / f"{probes[0][0].name}.plan.json"
    write_text_atomic(plan_file, json.dumps(plan, indent=1))
    code, tail = machine.job(["-m", "dptrain.tune.probe_runs", str(plan_file)], timeout * len(plan))
    if code != 0:
        stopped = next((p["run_dir"] for p in plan if not (Path(p["run_dir"]) / "summary.json").is_file()), "?")
        why = "hung: stopped at the timeout" if code == 124 else f"exit {code}" + (f": {tail}" if tail else "")
        raise TrialFailed(f"the probe job stopped in {stopped}: {why}")
    measured = []
    for p in plan:
        measured.append(read_steps(Path(p["run_dir"]), warmup))
        prune(Path(p["run_dir"]))
    return measured


def main(argv: list[str] | None = None) -> int:
    """One rank of a probe job: every run of PLAN.json in order, in one process group."""
    from dptrain.runner.loop import train  # after the argument check, as dptrain.run does

    parser = argparse.ArgumentParser(prog="python -m dptrain.tune.probe_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", help="JSON: [{\"config\": FILE, \"run_dir\": DIR}, ...]")
    args = parser.parse_args(argv)
    env = detect_worker_env()
    plans = []
    for p in json.loads(Path(args.plan).read_text()):
        cfg = load_config(p["config"], [f"run_dir={json.dumps(p['run_dir'])}"])
        plans.append(validate_run(cfg, env.world_size, check_forward=False))
    backends = {rp.cfg.distributed.backend for rp in plans}
    if len(backends) > 1:
        print(f"error: the probes of one job must share a backend, got {sorted(backends)}", file=sys.stderr)
        return 2
    if omp_threads(os.environ) is None:
        torch.set_num_threads(threads_per_worker(env.local_world_size))
    if not torch.cuda.is_available():
        tune_cpu_allocator()
    backend, timeout_s = plans[0].cfg.distributed.backend, plans[0].cfg.distributed.timeout_s
    store = join_store(env, timedelta(seconds=timeout_s))
    for i, rp in enumerate(plans):  # each run its own process group: new connections, as in a job of its own
        device = init_distributed(env, backend, timeout_s, store=dist.PrefixStore(f"probe{i}", store))
        try:
            train(rp, env, device)
        finally:
            leave_process_groups()  # every group the run made, its engine and buffers, before the next is timed
    return 0


if __name__ == "__main__":
    sys.exit(main())
