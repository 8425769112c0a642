"""Run N workers on this machine: the default for ``dptrain run --nproc N``.

Each worker runs ``dptrain.run`` with torchrun's environment variables set, so a worker
cannot tell this launcher from torchrun: a fork of a process that has imported torch
once, or a fresh ``python -m dptrain.run`` (``launch.workers``). The launcher owns the
job's lifetime:

- rank 0 writes to the terminal; every rank also logs to ``logs/rank<r>.log``;
- when a rank fails, the others get a few seconds to fail too (a dead peer ends their
  collectives quickly), then are terminated; the root cause's traceback is shown first:
  failures that only report a lost peer ("Connection reset by peer") come after the
  rest, and within each kind the earliest failure (its error record's time, or when its
  process died) comes first;
- a running rank whose heartbeat (``launch.heartbeat``) is older than the timeout is stopped
  as a whole process (SIGSTOP, a frozen machine): the job ends, naming it;
- Ctrl-C reaches every worker (same process group); they stop, and the launcher exits
  130 after giving stragglers a few seconds. SIGTERM to the launcher stops its workers
  the same way (exit 143).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dptrain.launch.errors import error_file, error_summary, read_error_record, write_error_record
from dptrain.launch.heartbeat import STALE_MIN_S, heartbeat_file, process_state, read_heartbeats, stale_ranks
from dptrain.launch.output import PrefixedOutput
from dptrain.launch.threads import threads_per_worker
from dptrain.launch.workers import start_worker

__all__ = ["launch_local", "interruptible", "free_port", "threads_per_worker", "error_file", "write_error_record", "error_summary", "PEER_LOST", "TIMED_OUT",
           "read_error_record"]

GRACE_S = 5.0  # from SIGTERM to SIGKILL when stopping workers
FAIL_GRACE_S = 2.0  # after the first failure, the others' time to fail too, beyond their roll call
SETTLE_S = 1.0  # [Note: settle before going on]

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # a MASTER_ADDR that keeps a job on this machine
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torch's: "True" makes every rank a client of the store at MASTER_*

# What a rank reports when a *peer* died: a consequence, not a cause.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|remote process exited|Broken pipe|"
                        r"ProcessGroup.*(aborted|terminated)", re.IGNORECASE)


# What a rank reports when a collective waited past distributed.timeout_s.
TIMED_OUT = re.compile(r"timed out|timeout|DistBackendError.*watchdog", re.IGNORECASE)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, worker_args: list[str], run_dir: Path, timeout_s: float,
                 expendable: set[int] = frozenset(), start_method: str = "forkserver", roll_call_s: float = 3.0,
                 preload: tuple[str, ...] = (), module: str = "dptrain.run", env: dict[str, str] | None = None,
                 shown: frozenset[int] | None = None, lock_fd: int | None = None) -> int:
    """Start ``nproc`` workers, wait for them, return the job's exit code.

    The failure of an ``expendable`` rank (a worker of an async parameter-server job)
    does not end the job: it is reported, and the job's exit code is that of the rest.
    ``start_method``: ``forkserver`` or ``exec`` (see ``launch.workers``). After a rank
    fails, the others get their roll call (``roll_call_s``, see ``train.roll_call``) and
    ``FAIL_GRACE_S`` more to fail too before they are stopped. Workers never outlive the
    launcher: whatever ends it (an exception, an interrupt, SIGTERM), they are stopped.
    ``preload``: modules forked workers find imported (``start_worker``). ``module``: what each
    worker runs, ``python -m MODULE WORKER_ARGS`` (``dptrain.launch.script`` for ``dptrain
    launch``); ``env``: added to the workers' environment. ``shown``: the ranks whose output the
    terminal shows, each line prefixed ``[rank r]`` (``launch.output``); None: rank 0's, as it is.
    ``lock_fd``: the locked run directory's descriptor, which every worker holds too (``launch.run_lock``).
    """
    port = free_port()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs, relays = [], []
    for rank in range(nproc):
        error_file(run_dir, rank).unlink(missing_ok=True)  # from an earlier attempt in this directory
        heartbeat_file(run_dir, rank).unlink(missing_ok=True)
    loopback = {} if "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": "lo"}  # every rank is here
    for rank in range(nproc):
        worker_env = dict(os.environ, **loopback, **(env or {}), RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), DPTRAIN_LAUNCHER="local")
        console = logs / f"rank{rank}.console"
        relay = PrefixedOutput(rank, console) if shown is not None and rank in shown else None
        output = (relay.out_w, relay.err_w) if relay else None if shown is None and rank == 0 else console
        try:
            procs.append(start_worker(start_method, worker_args, worker_env, output, preload, module, lock_fd))
        except BaseException:
            _stop(procs, grace=GRACE_S)
            raise
        if relay is not None:
            relay.start()
            relays.append(relay)
    exit_times = [0.0] * nproc
    for rank, proc in enumerate(procs):  # exact exit times, to order failures
        threading.Thread(target=_note_exit, args=(proc, exit_times, rank), daemon=True).start()
    terminal = frozenset({0} if shown is None else shown)  # the ranks whose output the terminal shows
    try:
        return interruptible(procs, lambda: _supervise(procs, exit_times, run_dir,
                                                       min(FAIL_GRACE_S + roll_call_s, timeout_s), expendable,
                                                       timeout_s, terminal))
    finally:
        _stop(procs, grace=GRACE_S)  # a no-op when they have ended
        for relay in relays:
            relay.close()


def interruptible(procs: list, supervise: Callable[[], int]) -> int:
    """``supervise()``'s exit code; on Ctrl-C (130) or SIGTERM (143) the workers in ``procs`` are stopped first."""
    try:
        with _sigterm_raises():
            return supervise()
    except KeyboardInterrupt:
        _stop(procs, grace=GRACE_S * 2)
        print("\ninterrupted: workers stopped", file=sys.stderr)
        return 130
    except _Terminated:
        _stop(procs, grace=GRACE_S * 2)
        print("terminated (SIGTERM): workers stopped", file=sys.stderr)
        return 128 + signal.SIGTERM


class _Terminated(Exception):
    """The launcher got SIGTERM (``kill``, a scheduler's cancel): its workers are stopped before it exits."""


@contextlib.contextmanager
def _sigterm_raises():
    """While supervising, SIGTERM raises :class:`_Terminated` instead of ending the launcher on the spot
    (which would leave its workers training). Signal handlers belong to the main thread: elsewhere, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise _Terminated()
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _note_exit(proc: subprocess.Popen, exit_times: list[float], rank: int) -> None:
    proc.wait()
    exit_times[rank] = time.time()


def _supervise(procs: list[subprocess.Popen], exit_times: list[float], run_dir: Path, grace_s: float,
               expendable: set[int], timeout_s: float = float("inf"), terminal: frozenset[int] = frozenset()) -> int:
    first_failure, survived, pending, stopped_dead = None, set(), {}, {}
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r in _stopped_ranks(procs, codes, run_dir, timeout_s, stopped_dead):
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
                    print(f"warning: rank {r} exited with {_describe(codes[r])}; the run goes on without it "
                          f"(see {run_dir / 'logs'})", file=sys.stderr)
        if all(c == 0 or r in survived for r, c in enumerate(codes)):
            return 0
        failed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in survived and r not in pending]
        if failed and first_failure is None:
            first_failure = time.monotonic()
        running = {r for r, c in enumerate(codes) if c is None}
        if first_failure is not None and (not running or time.monotonic() - first_failure > grace_s
                                          or running <= _silent(run_dir, failed)):
            stopped = _stop(procs, grace=GRACE_S)
            if _bad_input(procs, stopped):
                return 2  # the workers printed the error themselves
            _report_failure(procs, exit_times, stopped, run_dir, stopped_dead, timeout_s, terminal)
            return 1
        time.sleep(0.2)


def _bad_input(procs: list[subprocess.Popen], stopped: set[int]) -> bool:
    """Bad input ended the job: a rank exited 2 (it said why), and every other one exited 0 or 2, or was stopped
    by us while it waited for that rank (a store it could not reach, a collective it never got)."""
    codes = [p.returncode for p in procs]
    return 2 in codes and all(c in (0, 2) or r in stopped for r, c in enumerate(codes))


def _stopped_ranks(procs, codes: list[int | None], run_dir: Path, timeout_s: float, known: dict) -> list[int]:
    """Running ranks whose heartbeat is older than the timeout: stopped as a whole (their heartbeat thread too)."""
    if timeout_s == float("inf"):
        return []
    beats = read_heartbeats(run_dir, len(procs))
    return [r for r in stale_ranks(beats, timeout_s) if codes[r] is None and r not in known
            and beats[r].get("pid") == procs[r].pid]


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


def _stop(procs: list[subprocess.Popen], grace: float) -> set[int]:
    """SIGTERM the running workers, SIGKILL them after ``grace``; return the ranks we signalled.

    (Which ranks we stopped is known exactly here; telling them apart afterwards by exit
    times raced with the threads that note those times.)
    """
    signalled = set()
    for rank, p in enumerate(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a stopped process (SIGSTOP) acts on the SIGTERM only once continued
            signalled.add(rank)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return signalled


def _report_failure(procs: list[subprocess.Popen], exit_times: list[float], stopped: set[int],
                    run_dir: Path, stopped_dead: dict | None = None, timeout_s: float = float("inf"),
                    terminal: frozenset[int] = frozenset()) -> None:
    records = []
    for rank, p in enumerate(procs):
        record = read_error_record(run_dir, rank)
        if rank in (stopped_dead or {}):  # its heartbeat went stale: the root cause, whatever the others saw
            how = ("was stopped (SIGSTOP, a frozen machine)" if stopped_dead[rank] in ("T", "t") else
                   "was stuck where its heartbeat thread could not run (outside Python, holding the GIL)")
            died = (f"sent no heartbeat for over {max(timeout_s, STALE_MIN_S):g} s while running: the process "
                    f"{how}, and was killed{_look(run_dir, rank, rank in terminal)}")
            records.append((False, 0.0, rank, died, died))
        elif record is not None:
            text = record["traceback"]
            last = text.strip().splitlines()[-1] if text.strip() else "?"
            when = record.get("time") if isinstance(record.get("time"), (int, float)) else exit_times[rank]
            records.append((bool(PEER_LOST.search(text)), when, rank, text, str(record.get("summary", last))))
        elif p.returncode not in (0, None) and not (p.returncode < 0 and rank in stopped):
            # died on its own (a signal we did not send, or before it could record why)
            unreadable = " (its error record is empty or unreadable)" if error_file(run_dir, rank).exists() else ""
            died = (f"exited with {_describe(p.returncode)} without recording why{unreadable}"
                    f"{_look(run_dir, rank, rank in terminal)}")
            records.append((False, exit_times[rank] or float("inf"), rank, died, died))
    records.sort()
    full = disk_full_note(run_dir)
    if not records:
        print(f"error: a worker failed without reporting why{_look(run_dir, None, False)}", file=sys.stderr)
    else:
        _, _, rank, text, _ = records[0]
        print(f"\nerror: rank {rank} failed first:\n{text.rstrip()}", file=sys.stderr)
        for _, _, other, _, summary in records[1:]:
            print(f"(rank {other} also failed: {summary})", file=sys.stderr)
        failed = {r for _, _, r, _, _ in records}
        running = sorted(r for r in stopped if r not in failed)
        if running and any(TIMED_OUT.search(t) for _, _, _, t, _ in records):
            print(f"rank(s) {running} were still running when the others timed out waiting for them, and were "
                  f"stopped: the likely cause (a hang, or a rank that stopped calling collectives). Their logs: "
                  f"{run_dir / 'logs'}", file=sys.stderr)
    if full:
        print(full, file=sys.stderr)


def _look(run_dir: Path, rank: int | None, on_terminal: bool) -> str:
    """Where a rank's own words are, naming only what exists: its output above, its console file, its log."""
    logs = run_dir / "logs"
    files = [] if rank is None else [logs / f"rank{rank}.console", logs / f"rank{rank}.log"]
    places = (["its output above"] if on_terminal else []) + [str(f) for f in files if f.is_file()]
    if rank is None and logs.is_dir():
        places.append(f"the logs in {logs}")
    return f"; see {' and '.join(places)}" if places else ""


def disk_full_note(run_dir: Path, below: int = 1 << 20) -> str | None:
    """What to say when the file system holding ``run_dir`` is full (less than ``below`` bytes free), or None."""
    try:
        usage = shutil.disk_usage(run_dir)
    except OSError:
        return None
    if usage.free >= below:
        return None
    return (f"the file system holding {run_dir} is full ({usage.free:,} bytes free of {usage.total:,}): writes there "
            "fail (No space left on device), so the workers could not save, log or record why they failed. Free "
            "space there, or choose a --run-dir on another file system, and start again (the run resumes from its "
            "newest complete checkpoint)")


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
