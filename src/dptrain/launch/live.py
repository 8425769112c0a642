"""Run N workers on this machine under live recovery (``dptrain run --nproc N`` with ``live.enabled``).

Unlike :mod:`~dptrain.launch.local`, a failed worker does not end the job: the others go on
in rounds of their own (:mod:`dptrain.live`), and this launcher restarts only the worker
that failed (up to ``live.max_restarts`` times each), which joins the next round and is
healed by a peer. The launcher serves the job's live store itself, on 127.0.0.1: the store
outlives every worker. A worker that is stopped as a whole (SIGSTOP, or stuck where its
heartbeat thread cannot run) is killed once its heartbeat file is stale, then restarted
like any other failure. The job ends when replica 0, which writes the run's records, has
finished: the others are given ``finish_grace_s`` to finish too, then stopped. It fails
when a worker reports bad input (exit 2), when one finds that live recovery cannot go on
(exit 3: too few workers left, ``live.min_workers``, or none holding the training state;
its reason printed once), or when replica 0 fails past its restarts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from dptrain.launch.errors import error_file, read_error_record
from dptrain.launch.heartbeat import heartbeat_file
from dptrain.launch.local import (
    GRACE_S,
    _describe,
    _report_failure,
    _stop,
    _stopped_ranks,
    free_port,
    interruptible,
)
from dptrain.launch.workers import start_worker
from dptrain.live.quorum import GIVE_UP_EXIT
from dptrain.live.store import LIVE_STORE_ENV, serve_store

__all__ = ["launch_live"]

POLL_S = 0.2


def launch_live(nproc: int, worker_args: list[str], run_dir: Path, *, heartbeat_timeout_s: float, max_restarts: int,
                finish_grace_s: float, start_method: str = "forkserver", preload: tuple[str, ...] = (),
                lock_fd: int | None = None, stall_timeout_s: float = float("inf")) -> int:
    """Start ``nproc`` workers, restart those that fail, return the job's exit code (see the module docstring).

    ``stall_timeout_s``: a running worker whose heartbeat file is older than this is killed (and restarted).
    """
    store = serve_store("127.0.0.1", 0)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for rank in range(nproc):
        error_file(run_dir, rank).unlink(missing_ok=True)
        heartbeat_file(run_dir, rank).unlink(missing_ok=True)
    loopback = {} if "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": "lo"}
    base = dict(os.environ, **loopback, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DPTRAIN_LAUNCHER="local",
                **{LIVE_STORE_ENV: f"127.0.0.1:{store.port}"})
    restarts = [0] * nproc

    def start(rank: int):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), TORCHELASTIC_RESTART_COUNT=str(restarts[rank]))
        name = f"rank{rank}.console" if restarts[rank] == 0 else f"rank{rank}.restart{restarts[rank]}.console"
        console = None if rank == 0 and restarts[rank] == 0 else logs / name
        return start_worker(start_method, worker_args, env, console, preload, "dptrain.run", lock_fd)

    procs = []
    try:
        for rank in range(nproc):
            procs.append(start(rank))
        return interruptible(procs, lambda: _supervise(procs, start, restarts, run_dir, max_restarts, finish_grace_s,
                                                       stall_timeout_s))
    finally:
        _stop(procs, grace=GRACE_S)
        with contextlib.suppress(Exception):
            del store


def _supervise(procs: list, start, restarts: list[int], run_dir: Path, max_restarts: int, finish_grace_s: float,
               stall_timeout_s: float) -> int:
    finished_at = None
    while True:
        codes = [p.poll() for p in procs]
        for r in _stopped_ranks(procs, codes, run_dir, stall_timeout_s, {}):
            procs[r].kill()
            codes[r] = procs[r].wait()
            print(f"dptrain run: worker {r} sent no heartbeat for {stall_timeout_s:g} s (stopped or stuck) and was "
                  "killed", file=sys.stderr)
        if 2 in codes:  # bad input: every worker said why, or will
            _stop(procs, grace=GRACE_S)
            return 2
        if GIVE_UP_EXIT in codes:  # live recovery cannot go on: a restart would not help; the worker's reason, once
            _stop(procs, grace=GRACE_S)
            first = codes.index(GIVE_UP_EXIT)
            if first != 0 or restarts[0] > 0:  # replica 0's first console is this one: it has said it already
                _say_why(run_dir, first)
            return 1
        if codes[0] == 0 and finished_at is None:
            finished_at = time.monotonic()
        if all(c == 0 for c in codes) or (finished_at is not None and None not in codes):
            return 0  # every worker done; after replica 0 finished, a worker that failed no longer matters
        for r, code in enumerate(codes):
            if code in (None, 0) or finished_at is not None:
                continue
            if restarts[r] >= max_restarts:
                if r == 0 or all(c not in (None, 0) for c in codes):
                    _stop(procs, grace=GRACE_S)
                    _report_failure(procs, [0.0] * len(procs), set(), run_dir)
                    return 1
                continue
            restarts[r] += 1
            print(f"dptrain run: worker {r} exited with {_describe(code)}; restarting it ({restarts[r]} of "
                  f"live.max_restarts = {max_restarts}); the others go on", file=sys.stderr)
            error_file(run_dir, r).unlink(missing_ok=True)
            procs[r] = start(r)
        if finished_at is not None and time.monotonic() - finished_at > finish_grace_s:
            late = [r for r, c in enumerate(codes) if c is None]
            _stop(procs, grace=GRACE_S)
            if late:
                print(f"dptrain run: worker(s) {late} had not finished {finish_grace_s:g} s after replica 0 did, "
                      "and were stopped", file=sys.stderr)
            return 0
        time.sleep(POLL_S)


def _say_why(run_dir: Path, rank: int) -> None:
    """A worker's one line on why live recovery cannot go on, on the console (a restarted worker's own console is a
    file under logs/, and replica 0's first one the only one shown)."""
    record = read_error_record(run_dir, rank) or {}
    text = str(record.get("traceback", "")).strip().removeprefix("error: ")
    print(f"error: worker {rank}: {text or 'live recovery cannot go on'}", file=sys.stderr)
