"""The worker entry point: ``python -m dptrain.run [--config FILE] [--set key=value ...]``.

``dptrain run --nproc N`` starts N of these; on a cluster, start them with torchrun
(``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400
-m dptrain.run --config job.toml``) or Slurm (``srun python -m dptrain.run ...``); the
rank, world size and rendezvous come from their environment (``launch.rendezvous``).

Exit codes: 0 done; 2 bad input (config, batch sizes, model factory, checkpoint), raised
before anything is written, or a run directory another run holds (rank 0 takes its lock,
``launch.run_lock``, unless this worker's launcher holds it, which the worker proves by
the lock's inherited descriptor or, under torchrun's agent, by its token); 130
interrupted; 3 live recovery cannot go on (too few workers: ``live.min_workers``); 1 anything else, with the traceback in ``logs/rank<r>.error.json`` for the
launcher to show (and torchrun's error file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from dptrain.utils.collector import collector_paused, freeze_imports
from dptrain.utils.worker_exit import exit_worker

with collector_paused():  # torch and the training loop: a seventh less CPU to import (dptrain.utils.collector)
    import torch
    import torch._dynamo  # noqa: F401  a worker's first optimizer step imports it anyway: here, inside the pause
    import torch.distributed as dist

    from dptrain.allocator import tune_cpu_allocator
    from dptrain.batching import BatchSizeError
    from dptrain.checkpoint.files import CheckpointError
    from dptrain.config import ConfigError, load_config
    from dptrain.launch.errors import error_summary, write_error_record
    from dptrain.launch.heartbeat import end_stopped_peers
    from dptrain.launch.orphans import orphan_guard
    from dptrain.launch.rendezvous import (
        PortInUse,
        RendezvousTimeout,
        detect_worker_env,
        init_alone,
        init_distributed,
        leave_process_groups,
        replica_env,
    )
    from dptrain.launch.run_lock import TOKEN_ENV, RunDirError, RunLock, acquire, inherited, keep_inherited
    from dptrain.launch.threads import omp_threads, threads_per_worker
    from dptrain.live import GIVE_UP_EXIT, TooFewWorkers
    from dptrain.live.layout import ShardGroupLost
    from dptrain.runner.skips import NonFiniteRun
    from dptrain.runner.validate import default_run_dir, validate_run
    from dptrain.utils.files import UnsafePath

__all__ = ["main", "BAD_INPUT"]

BAD_INPUT = (ConfigError, BatchSizeError, CheckpointError, UnsafePath, PortInUse)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dptrain.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.lr=3e-4 (repeatable)")
    parser.add_argument("--strategy", help="the data-parallel strategy (same as --set distributed.strategy=...)")
    parser.add_argument("--run-dir", help="the run directory (same as --set run_dir=...)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    orphan_guard(os.environ)  # started by a local launcher as a fresh interpreter: end with it
    keep_inherited(os.environ)
    args = parse_args(argv)
    try:
        env = replica_env(detect_worker_env())  # live recovery's replica, where its launcher is one per replica
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    local = os.environ.get("DPTRAIN_LAUNCHER") == "local"  # a claim: the lock's descriptor proves it (below)
    run_dir = None
    try:
        overrides = ([f"distributed.strategy={json.dumps(args.strategy)}"] if args.strategy else []) + \
            list(args.overrides) + ([f"run_dir={json.dumps(args.run_dir)}"] if args.run_dir else [])
        notes: list[str] = []  # old keys' deprecation lines, printed with the warnings below
        cfg = load_config(args.config, overrides, notes)
        run_dir = default_run_dir(cfg).resolve()
        local = local and inherited(run_dir, os.environ) is not None
        rp = validate_run(cfg, env.world_size, check_forward=not local)  # `dptrain run` traced the forward already
        if rp.cfg.live.enabled:
            _check_live_store()
    except BAD_INPUT as e:
        if env.rank == 0 or not local:  # the local launcher already reported it once
            print(f"error: {e}", file=sys.stderr)
        return 2
    if env.rank == 0 and not local:  # under torchrun or Slurm no launcher printed them
        for line in [*notes, *rp.warnings]:
            print(line, file=sys.stderr)
    if omp_threads(os.environ) is None:  # unset, or not a thread count (torch ignores such a value too)
        torch.set_num_threads(threads_per_worker(env.local_world_size))
    if not torch.cuda.is_available():
        tune_cpu_allocator()
    lock = None
    try:
        live = rp.cfg.live.enabled  # each worker a process group of its own; the rounds span the job (dptrain.live)
        device = init_alone(env, rp.cfg.distributed.backend) if live else init_distributed(env, rp.cfg.distributed.backend,
                                                                                   rp.cfg.distributed.timeout_s)
        lock = None if local else _lock_run_dir(env, rp.run_dir)  # `dptrain run` holds it for its workers
        from dptrain.runner.loop import train  # after init: keeps `--help` and bad-input paths fast

        facts = train(rp, env, device)
        if facts is not None:  # rank 0
            _write_pages(rp, facts)
        return 0
    except KeyboardInterrupt:
        return 130
    except RunDirError as e:
        if env.rank == 0:  # the others exit 2 too, silently: one message
            print(f"error: {e}", file=sys.stderr)
        return 2
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RendezvousTimeout as e:  # one line names the address and what to check, on every rank that waited
        write_error_record(run_dir, env.rank, f"error: {e}", error_summary(e))
        if not local:  # the local launcher shows the record itself
            print(f"error: {e}", file=sys.stderr)
        return 1
    except (ShardGroupLost, TooFewWorkers) as e:  # live recovery: one message. Its shard group broke: exit 1, and
        write_error_record(run_dir, env.rank, f"error: {e}", error_summary(e))  # its launcher restarts it; it cannot
        print(f"error: {e}", file=sys.stderr)  # go on: GIVE_UP_EXIT, which its launcher does not restart
        return 1 if isinstance(e, ShardGroupLost) else GIVE_UP_EXIT
    except NonFiniteRun as e:  # every rank stops at the same step: one message, no traceback
        write_error_record(run_dir, env.rank, f"error: {e}", error_summary(e))
        if env.rank == 0 and not local:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        silent = getattr(e, "silent_ranks", [])
        if not local and silent and run_dir is not None:  # torchrun would wait 30 s for a stopped peer to end
            ended = end_stopped_peers(run_dir, silent, env.world_size)
            if ended:
                e.add_note(f"rank(s) {ended} were stopped (SIGSTOP) on this host and were ended (SIGKILL), so "
                           "that the job can end at once")
        text = traceback.format_exc()
        write_error_record(run_dir, env.rank, text, error_summary(e), silent)
        if not local:  # the local launcher prints the first failing rank's traceback itself
            print(text, file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.release()
        leave_process_groups()


def _check_live_store() -> None:
    """Live recovery's store must be named (``DPTRAIN_LIVE_STORE``): bad input, before anything starts."""
    from dptrain.live.store import store_address

    try:
        store_address()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _write_pages(rp, facts) -> None:
    """Rank 0, after the loop: plots, summary.json and report.html from the run directory's files; then the
    summary, on the console and in rank 0's log (``dptrain.pages.finish``)."""
    from dptrain.pages.finish import write_run_pages  # the pages are above the loop: it never imports them
    from dptrain.runner.report import RunLog, print_summary

    log = RunLog(rp.run_dir / "logs" / "rank0.log", 0, "lines", facts.steps, facts.start_step)
    try:
        print_summary(write_run_pages(rp.run_dir, facts, rp.cfg, log.info), log)
    finally:
        log.close()


def _lock_run_dir(env, run_dir) -> RunLock | None:
    """Under torchrun or Slurm: rank 0 takes the run directory's lock for the job (``launch.run_lock``).

    Every rank learns the outcome (one broadcast), so a second job on a run directory
    in use exits 2 on every rank at once instead of hanging in its first collective.
    Under ``dptrain run --max-restarts`` the launcher holds the lock and exports its
    token, which :func:`acquire` recognises as its own.
    """
    lock, message = None, ""
    token = os.environ.pop(TOKEN_ENV, None)  # read once: nothing this worker starts inherits the claim
    if env.rank == 0:
        try:
            lock = acquire(run_dir, "python -m dptrain.run (rank 0)",
                           environ={TOKEN_ENV: token} if token else {})
        except RunDirError as e:
            message = str(e)
    if env.world_size > 1:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message:
        raise RunDirError(message)
    return lock


if __name__ == "__main__":
    freeze_imports()  # a worker's full collections, and its exit, walk none of torch's objects (dptrain.utils.collector)
    exit_worker(main())  # its end short of the interpreter's teardown (dptrain.utils.worker_exit)
