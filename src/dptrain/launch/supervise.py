"""What every launcher of local workers does with them once started (``launch.local``): stop them (SIGTERM, then
SIGKILL), find the ones whose heartbeat went stale, stop them all on Ctrl-C or SIGTERM, and report a failed job with
the rank that failed first named, its traceback first.

The order of a failure report: failures that only report a lost peer ("Connection reset by
peer") come after the rest, and within each kind the earliest failure (its error record's
time, or when its process died) comes first; a rank whose heartbeat went stale while it ran
(stopped as a whole, SIGSTOP, or stuck where its heartbeat thread could not run) is the root
cause, whatever the others saw.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dptrain.launch.errors import error_file, read_error_record
from dptrain.launch.heartbeat import STALE_MIN_S, read_heartbeats, stale_ranks

__all__ = ["GRACE_S", "PEER_LOST", "TIMED_OUT", "interruptible", "stale_workers", "stop_workers", "report_failure",
           "disk_full_note", "describe", "look"]

GRACE_S = 5.0  # from SIGTERM to SIGKILL when stopping workers

# What a rank reports when a *peer* died: a consequence, not a cause.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|remote process exited|Broken pipe|"
                        r"ProcessGroup.*(aborted|terminated)", re.IGNORECASE)


# What a rank reports when a collective waited past distributed.timeout_s.
TIMED_OUT = re.compile(r"timed out|timeout|DistBackendError.*watchdog", re.IGNORECASE)


def interruptible(procs: list, supervise: Callable[[], int]) -> int:
    """``supervise()``'s exit code; on Ctrl-C (130) or SIGTERM (143) the workers in ``procs`` are stopped first."""
    try:
        with _sigterm_raises():
            return supervise()
    except KeyboardInterrupt:
        stop_workers(procs, grace=GRACE_S * 2)
        print("\ninterrupted: workers stopped", file=sys.stderr)
        return 130
    except _Terminated:
        stop_workers(procs, grace=GRACE_S * 2)
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


def stale_workers(procs, codes: list[int | None], run_dir: Path, timeout_s: float, known: dict) -> list[int]:
    """Running ranks whose heartbeat is older than the timeout: stopped as a whole (their heartbeat thread too)."""
    if timeout_s == float("inf"):
        return []
    beats = read_heartbeats(run_dir, len(procs))
    return [r for r in stale_ranks(beats, timeout_s) if codes[r] is None and r not in known
            and beats[r].get("pid") == procs[r].pid]


def stop_workers(procs: list[subprocess.Popen], grace: float) -> set[int]:
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


def report_failure(procs: list[subprocess.Popen], exit_times: list[float], stopped: set[int],
                    run_dir: Path, stopped_dead: dict | None = None, timeout_s: float = float("inf"),
                    terminal: frozenset[int] = frozenset()) -> None:
    records = []
    for rank, p in enumerate(procs):
        record = read_error_record(run_dir, rank)
        if rank in (stopped_dead or {}):  # its heartbeat went stale: the root cause, whatever the others saw
            how = ("was stopped (SIGSTOP, a frozen machine)" if stopped_dead[rank] in ("T", "t") else
                   "was stuck where its heartbeat thread could not run (outside Python, holding the GIL)")
            died = (f"sent no heartbeat for over {max(timeout_s, STALE_MIN_S):g} s while running: the process "
                    f"{how}, and was killed{look(run_dir, rank, rank in terminal)}")
            records.append((False, 0.0, rank, died, died))
        elif record is not None:
            text = record["traceback"]
            last = text.strip().splitlines()[-1] if text.strip() else "?"
            when = record.get("time") if isinstance(record.get("time"), (int, float)) else exit_times[rank]
            records.append((bool(PEER_LOST.search(text)), when, rank, text, str(record.get("summary", last))))
        elif p.returncode not in (0, None) and not (p.returncode < 0 and rank in stopped):
            # died on its own (a signal we did not send, or before it could record why)
            unreadable = " (its error record is empty or unreadable)" if error_file(run_dir, rank).exists() else ""
            died = (f"exited with {describe(p.returncode)} without recording why{unreadable}"
                    f"{look(run_dir, rank, rank in terminal)}")
            records.append((False, exit_times[rank] or float("inf"), rank, died, died))
    records.sort()
    full = disk_full_note(run_dir)
    if not records:
        print(f"error: a worker failed without reporting why{look(run_dir, None, False)}", file=sys.stderr)
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


def look(run_dir: Path, rank: int | None, on_terminal: bool) -> str:
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


def describe(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
