"""Run N workers on this machine: ``dptrain run --nproc N`` and ``dptrain launch`` on one machine.

Each worker runs ``dptrain.run`` (or ``dptrain.launch.script``) with torchrun's environment
variables set, so a worker cannot tell this launcher from torchrun: a fork of a process that
has imported torch once, or a fresh ``python -m dptrain.run`` (``launch.workers``). The
launcher owns the job's lifetime, by one of two restart policies:

- **the whole job** (the default; torchrun's agent restarts the whole job with ``--max-restarts``,
  ``launch.elastic``): when a rank fails, the others get a few seconds to fail too (a dead peer
  ends their collectives quickly), then are terminated, and the root cause's traceback is shown
  first (``launch.supervise``); a running rank whose heartbeat (``launch.heartbeat``) is older
  than the timeout is stopped as a whole process (SIGSTOP, a frozen machine): the job ends,
  naming it;
- **the failed worker only** (:class:`RestartFailed`, live recovery: ``live.enabled``): the others go
  on in rounds of their own (``dptrain.live``), and the launcher restarts only the worker that
  failed (up to ``max_restarts`` times each), which joins the next round and is healed by a
  peer; a stale worker is killed and restarted like any other failure. The job ends when
  replica 0, which writes the run's records, has finished: the others are given
  ``finish_grace_s`` to finish too, then stopped. It fails when a worker reports bad input (exit
  2), when one finds that live recovery cannot go on (exit 3, ``GIVE_UP_EXIT``: too few workers
  left, or none holding the training state; its reason printed once), or when replica 0 fails
  past its restarts.

Under either, rank 0 writes to the terminal and every rank also logs to ``logs/rank<r>.log``;
Ctrl-C reaches every worker (same process group): they stop, and the launcher exits 130 after
giving stragglers a few seconds; SIGTERM to the launcher stops its workers the same way (exit 143).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dptrain.launch.errors import error_file, read_error_record
from dptrain.launch.heartbeat import heartbeat_file, process_state
from dptrain.launch.output import PrefixedOutput
from dptrain.launch.supervise import (
    GRACE_S,
    describe,
    interruptible,
    report_failure,
    stale_workers,
    stop_workers,
)
from dptrain.launch.workers import start_worker

__all__ = ["launch_local", "RestartFailed", "free_port", "LOOPBACK", "AGENT_STORE"]

POLL_S = 0.2
FAIL_GRACE_S = 2.0  # after the first failure, the others' time to fail too, beyond their roll call
SETTLE_S = 1.0  # [Note: settle before going on]

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # a MASTER_ADDR that keeps a job on this machine
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torch's: "True" makes every rank a client of the store at MASTER_*


@dataclass(frozen=True)
class RestartFailed:
    """The restart policy of live recovery: restart only the failed worker, up to ``max_restarts`` times each; the
    others go on. ``finish_grace_s``: after replica 0 finished, the others' time to finish too."""

    max_restarts: int
    finish_grace_s: float
    limit: str = "live.max_restarts"  # how the user set max_restarts, for the log's lines
    who: str = "dptrain run"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, worker_args: list[str], run_dir: Path, timeout_s: float,
                 expendable: set[int] = frozenset(), start_method: str = "forkserver", roll_call_s: float = 3.0,
                 preload: tuple[str, ...] = (), module: str = "dptrain.run", env: dict[str, str] | None = None,
                 shown: frozenset[int] | None = None, lock_fd: int | None = None,
                 restart: RestartFailed | None = None) -> int:
    """Start ``nproc`` workers, supervise them by the restart policy, return the job's exit code.

    ``timeout_s``: a running worker whose heartbeat is older than this is stopped (the whole job fails, naming it;
    under ``restart``, it is killed and restarted). The failure of an ``expendable`` rank (a worker of an async
    parameter-server job) does not end the job: it is reported, and the job's exit code is that of the rest.
    ``start_method``: ``forkserver`` or ``exec`` (see ``launch.workers``). After a rank fails, the others get their
    roll call (``roll_call_s``, see ``runner.roll_call``) and ``FAIL_GRACE_S`` more to fail too before they are
    stopped. Workers never outlive the launcher: whatever ends it (an exception, an interrupt, SIGTERM), they are
    stopped. ``preload``: modules forked workers find imported (``start_worker``). ``module``: what each worker
    runs, ``python -m MODULE WORKER_ARGS`` (``dptrain.launch.script`` for ``dptrain launch``); ``env``: added to
    the workers' environment. ``shown``: the ranks whose output the terminal shows, each line prefixed ``[rank r]``
    (``launch.output``); None: rank 0's, as it is. ``lock_fd``: the locked run directory's descriptor, which every
    worker holds too (``launch.run_lock``). ``restart``: None restarts nothing (the whole job fails with a rank);
    :class:`RestartFailed` restarts the failed worker only.
    """
    port = free_port()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs, relays = [], []
    for rank in range(nproc):
        error_file(run_dir, rank).unlink(missing_ok=True)  # from an earlier attempt in this directory
        heartbeat_file(run_dir, rank).unlink(missing_ok=True)
    loopback = {} if "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": "lo"}  # every rank is here
    base = dict(os.environ, **loopback, **(env or {}), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DPTRAIN_LAUNCHER="local")
    restarts = [0] * nproc

    def start(rank: int) -> subprocess.Popen:
        """Worker ``rank``, started (again, after ``restarts[rank]`` failures)."""
        again = restarts[rank]
        worker_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank),
                          **({"TORCHELASTIC_RESTART_COUNT": str(again)} if restart is not None else {}))
        console = logs / (f"rank{rank}.console" if not again else f"rank{rank}.restart{again}.console")
        relay = PrefixedOutput(rank, console) if shown is not None and rank in shown and not again else None
        on_terminal = shown is None and rank == 0 and not again
        output = (relay.out_w, relay.err_w) if relay else None if on_terminal else console
        proc = start_worker(start_method, worker_args, worker_env, output, preload, module, lock_fd)
        if relay is not None:
            relay.start()
            relays.append(relay)
        return proc

    try:
        for rank in range(nproc):
            procs.append(start(rank))
        if restart is not None:
            return interruptible(procs, lambda: _supervise_restarting(procs, start, restarts, run_dir, restart,
                                                                      timeout_s))
        exit_times = [0.0] * nproc
        for rank, proc in enumerate(procs):  # exact exit times, to order failures
            threading.Thread(target=_note_exit, args=(proc, exit_times, rank), daemon=True).start()
        terminal = frozenset({0} if shown is None else shown)  # the ranks whose output the terminal shows
        return interruptible(procs, lambda: _supervise(procs, exit_times, run_dir,
                                                       min(FAIL_GRACE_S + roll_call_s, timeout_s), expendable,
                                                       timeout_s, terminal))
    finally:
        stop_workers(procs, grace=GRACE_S)  # a no-op when they have ended
        for relay in relays:
            relay.close()


def _note_exit(proc: subprocess.Popen, exit_times: list[float], rank: int) -> None:
    proc.wait()
    exit_times[rank] = time.time()


def _supervise(procs: list[subprocess.Popen], exit_times: list[float], run_dir: Path, grace_s: float,
               expendable: set[int], timeout_s: float = float("inf"), terminal: frozenset[int] = frozenset()) -> int:
    first_failure, survived, pending, stopped_dead = None, set(), {}, {}
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r in stale_workers(procs, codes, run_dir, timeout_s, stopped_dead):
            stopped_dead[r] = process_state(procs[r].pid)
            procs[r].kill()  # a stopped process handles no SIGTERM: it is ended as a crash would end it
            codes[r] = procs[r].wait()
            exit_times[r] = time.time()
        for r in expendable - survived:  # [Note: settle before going on]
            if codes[r] not in (None, 0):
                since = pending.setdefault(r, now)
                if first_failure is None and now - since >= SETTLE_S:
                    survived.add(r)
                    del pending[r]
                    print(f"warning: rank {r} exited with {describe(codes[r])}; the run goes on without it "
                          f"(see {run_dir / 'logs'})", file=sys.stderr)
        if all(c == 0 or r in survived for r, c in enumerate(codes)):
            return 0
        failed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in survived and r not in pending]
        if failed and first_failure is None:
            first_failure = time.monotonic()
        running = {r for r, c in enumerate(codes) if c is None}
        if first_failure is not None and (not running or time.monotonic() - first_failure > grace_s
                                          or running <= _silent(run_dir, failed)):
            stopped = stop_workers(procs, grace=GRACE_S)
            if _bad_input(procs, stopped):
                return 2  # the workers printed the error themselves
            report_failure(procs, exit_times, stopped, run_dir, stopped_dead, timeout_s, terminal)
            return 1
        time.sleep(POLL_S)


def _supervise_restarting(procs: list, start, restarts: list[int], run_dir: Path, policy: RestartFailed,
                          stall_timeout_s: float) -> int:
    """The failed-worker-only policy (:class:`RestartFailed`; see the module docstring)."""
    from dptrain.live.quorum import GIVE_UP_EXIT  # live recovery's (it imports torch, which the launcher need not)

    finished_at = None
    while True:
        codes = [p.poll() for p in procs]
        for r in stale_workers(procs, codes, run_dir, stall_timeout_s, {}):
            procs[r].kill()
            codes[r] = procs[r].wait()
            print(f"{policy.who}: worker {r} sent no heartbeat for {stall_timeout_s:g} s (stopped or stuck) and "
                  "was killed", file=sys.stderr)
        if 2 in codes:  # bad input: every worker said why, or will
            stop_workers(procs, grace=GRACE_S)
            return 2
        if GIVE_UP_EXIT in codes:  # live recovery cannot go on: a restart would not help; the worker's reason, once
            stop_workers(procs, grace=GRACE_S)
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
            if restarts[r] >= policy.max_restarts:
                if r == 0 or all(c not in (None, 0) for c in codes):
                    stop_workers(procs, grace=GRACE_S)
                    report_failure(procs, [0.0] * len(procs), set(), run_dir)
                    return 1
                continue
            restarts[r] += 1
            print(f"{policy.who}: worker {r} exited with {describe(code)}; restarting it ({restarts[r]} of "
                  f"{policy.limit} = {policy.max_restarts}); the others go on", file=sys.stderr)
            error_file(run_dir, r).unlink(missing_ok=True)
            procs[r] = start(r)
        if finished_at is not None and time.monotonic() - finished_at > policy.finish_grace_s:
            late = [r for r, c in enumerate(codes) if c is None]
            stop_workers(procs, grace=GRACE_S)
            if late:
                print(f"{policy.who}: worker(s) {late} had not finished {policy.finish_grace_s:g} s after replica 0 "
                      "did, and were stopped", file=sys.stderr)
            return 0
        time.sleep(POLL_S)


def _say_why(run_dir: Path, rank: int) -> None:
    """A worker's one line on why live recovery cannot go on, on the console (a restarted worker's own console is a
    file under logs/, and replica 0's first one the only one shown)."""
    record = read_error_record(run_dir, rank) or {}
    text = str(record.get("traceback", "")).strip().removeprefix("error: ")
    print(f"error: worker {rank}: {text or 'live recovery cannot go on'}", file=sys.stderr)


def _bad_input(procs: list[subprocess.Popen], stopped: set[int]) -> bool:
    """Bad input ended the job: a rank exited 2 (it said why), and every other one exited 0 or 2, or was stopped
    by us while it waited for that rank (a store it could not reach, a collective it never got)."""
    codes = [p.returncode for p in procs]
    return 2 in codes and all(c in (0, 2) or r in stopped for r, c in enumerate(codes))


def _silent(run_dir: Path, failed: list[int]) -> set[int]:
    """The ranks that the failed ranks' roll calls found silent: they had their time already, and get no grace."""
    silent = set()
    for rank in failed:
        record = read_error_record(run_dir, rank)
        if record is not None:
            silent.update(r for r in record.get("silent_ranks", []) if isinstance(r, int))
    return silent


# [Note: settle before going on] An expendable rank's death is declared survivable only
# after SETTLE_S with no other failure: when a parameter server dies, its workers end with
# an error at about the same moment, and one of them may exit before the server's death is
# seen. Without the wait, that worker would be reported as lost and survived, just before
# the job fails for the server's death.


