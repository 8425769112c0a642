"""Heartbeats and the watchdog: every hang ends within the timeout, whichever rank stops and wherever.

A collective's timeout (``distributed.timeout_s``) ends the wait of the ranks *inside* a collective.
It does not end a wait elsewhere: a store access to a stopped store host (rank 0), a
parameter server's point-to-point receive, a rank whose own main thread is stuck, or a rank
that is stopped as a whole (SIGSTOP, a frozen machine). So every worker runs a daemon thread
that, about once a second, writes ``logs/rank<r>.heartbeat`` (JSON: the host, the wall-clock
and monotonic times, the step, the phase, and when the training loop last marked progress).
It has two readers:

- **the local launcher** (``launch.local``): a running rank whose heartbeat is older than
  the timeout is stopped as a whole (its heartbeat thread too): the launcher ends the job
  and names that rank (:func:`stale_ranks`);
- **the worker itself** (the watchdog, in the same thread): once armed by the loop's first
  :meth:`Heartbeat.mark`, a main thread that marks no progress for ``timeout_s + margin_s``
  writes its error record, naming the ranks whose heartbeats are stale or behind its own,
  and the process exits 1. That covers torchrun and Slurm, where no dptrain launcher watches.

The margin lets the precise paths speak first: a collective's own timeout and the roll call
(``train.roll_call``) that follows it. A script that never marks progress (a plain torch
script under ``dptrain launch``) gets the heartbeat without the watchdog: the launcher still
sees a stopped rank, and torch's collective timeout ends the others' waits.

A long phase that makes progress is not a hang: the loop marks progress at each micro-step,
each evaluation batch and each file of a checkpoint, so that only a stall is judged.

[Note: a heartbeat on a full disk] The file is created once, at a fixed size, and then
rewritten in place (one ``pwrite`` of :data:`RECORD_BYTES` at offset 0): rewriting blocks a
file already has needs no free space, so a full disk does not silence the heartbeats of
healthy ranks (a new file each second did, and the launcher then killed them as stopped).
A reader may catch a record half-written; :func:`read_heartbeats` leaves it out, and a
rank is judged stale only when its heartbeat stays old.

[Note: which clock] On one host the ages are measured with the monotonic clock, which
boot ID and ``time.monotonic()`` make comparable across processes: a step of the wall
clock (NTP, a resumed VM) larger than the timeout would otherwise make every heartbeat
look stale at once. Across hosts only the wall clock is shared.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from dptrain.utils.files import UnsafePath, open_fd, open_file

__all__ = ["Heartbeat", "heartbeat_file", "read_heartbeats", "stale_ranks", "heartbeat_age", "process_state",
           "mark_progress", "end_stopped_peers", "INTERVAL_S", "STALE_MIN_S", "RECORD_BYTES"]

INTERVAL_S = 1.0  # between two writes of a heartbeat file
STALE_MIN_S = 5.0  # a heartbeat is never called stale sooner: a loaded machine delays a thread by seconds
RECORD_BYTES = 512  # a heartbeat's fixed size on disk ([Note: a heartbeat on a full disk])

# The heartbeat of this process, for the progress marks of code that cannot be handed it: the Engine
# and prepare()'s optimizer inside a user's script that `dptrain launch` runs (launch.script starts
# the heartbeat; the script builds the Engine). One per process, set and cleared by Heartbeat itself.
_ACTIVE: list[Heartbeat] = []


def heartbeat_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank{rank}.heartbeat"


def mark_progress(step: int, phase: str = "step") -> None:
    """Mark progress on this process's heartbeat, if it has one (a no-op otherwise)."""
    if _ACTIVE:
        _ACTIVE[-1].mark(step, phase)


class Heartbeat:
    """This rank's heartbeat thread and watchdog (see the module's docstring). Use as a context manager."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float, margin_s: float = 5.0,
                 interval_s: float = INTERVAL_S):
        self.path = heartbeat_file(run_dir, rank)
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.timeout_s, self.margin_s, self.interval_s = timeout_s, margin_s, interval_s
        self.step, self.phase = 0, "start"
        self._progress: float | None = None  # monotonic time of the last mark; None: the watchdog is not armed
        self._failing = False
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dptrain-heartbeat-{rank}")

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # whatever was there (a link is removed, never followed)
        self._fd = open_fd(self.path, "x")
        self._write()
        _ACTIVE.append(self)
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:  # [Note: the error path ends too]
            self._failing = True
            self.mark(self.step, "failing")
            return
        self._stop.set()
        self._thread.join()
        self.phase, self._progress = "exited", None
        self._write()  # a run that ended is not one still going (launch.run_lock reads it)
        os.close(self._fd)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def mark(self, step: int, phase: str = "step") -> None:
        """The main thread made progress (a step began, a micro-step, an evaluation batch, a checkpoint file):
        arms the watchdog. Cheap: three assignments."""
        self.step, self.phase, self._progress = step, phase, time.monotonic()

    def disarm(self, phase: str = "finish") -> None:
        """Keep beating, stop watching: past the training loop (the summary, plots) nothing marks progress."""
        self.phase, self._progress = phase, None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()
            progress = self._progress
            if progress is not None and time.monotonic() - progress > self.timeout_s + self.margin_s:
                self._expire(time.monotonic() - progress)

    def _write(self) -> None:
        """Rewrite the record in place ([Note: a heartbeat on a full disk])."""
        since = None if self._progress is None else time.monotonic() - self._progress
        record = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "boot": _BOOT_ID,
                  "time": time.time(), "mono": time.monotonic(), "step": self.step, "phase": self.phase[:40],
                  "progress_age_s": since, "timeout_s": self.timeout_s}
        data = json.dumps(record).encode()[:RECORD_BYTES].ljust(RECORD_BYTES)
        with contextlib.suppress(OSError):  # the heartbeat is a convenience: the run goes on without it
            os.pwrite(self._fd, data, 0)

    def _expire(self, stalled_s: float) -> None:
        """No progress for too long: record why, naming the suspects, and end this process (exit 1)."""
        if self._failing:
            print(f"error: rank {self.rank} did not end within {stalled_s:.0f} s of its failure (a blocked "
                  "teardown, a stopped peer): exiting", file=sys.stderr, flush=True)
            os._exit(1)
        from dptrain.launch.errors import write_error_record

        others = read_heartbeats(self.run_dir, self.world_size)
        stale = stale_ranks(others, self.timeout_s, exclude={self.rank})
        ended = end_stopped_peers(self.run_dir, stale, self.world_size)
        behind = sorted(r for r, h in others.items() if r not in stale and h.get("step", 0) < self.step)
        who = (f"rank(s) {stale} sent no heartbeat for over {max(self.timeout_s, STALE_MIN_S):g} s (stopped or "
               "dead)" if stale else f"rank(s) {behind} are behind, at an earlier step" if behind else
               "no other rank's heartbeat looks wrong (are their logs/ visible from here?)")
        if ended:
            who += (f"; rank(s) {ended} were stopped (SIGSTOP) on this host and were ended (SIGKILL), so that "
                    "the job can end at once")
        summary = (f"WatchdogTimeout: rank {self.rank} made no progress for {stalled_s:.0f} s at step {self.step} "
                   f"({self.phase}), over distributed.timeout_s {self.timeout_s:g} s + {self.margin_s:g} s; {who}")
        text = (f"{summary}\nwhere each rank was: " + "; ".join(
            f"rank {r}: step {h.get('step')} ({h.get('phase')}), heartbeat {heartbeat_age(h):.0f} s ago"
            for r, h in sorted(others.items())) + "\n")
        try:
            write_error_record(self.run_dir, self.rank, text, summary, stale or behind)
            print(f"error: {summary}", file=sys.stderr, flush=True)
        finally:
            os._exit(1)  # the main thread is stuck: no clean exit can be waited for


# [Note: the error path ends too] A rank that failed still has to get out: reporting, destroying its
# process groups. With a stopped peer or store host either can block. So an exception leaving the
# heartbeat's context keeps the thread beating and the watchdog armed: a process that has not ended
# timeout_s + margin_s later exits 1 (its error record, written already, stays as it is).


def read_heartbeats(run_dir: Path, world_size: int) -> dict[int, dict]:
    """Every rank's last heartbeat that can be read (a missing or half-written file is left out)."""
    beats = {}
    for rank in range(world_size):
        try:
            with open_file(heartbeat_file(run_dir, rank), "rb") as f:
                beat = json.loads(f.read(RECORD_BYTES * 2))
        except (OSError, ValueError, UnsafePath):
            continue
        if isinstance(beat, dict) and isinstance(beat.get("time"), (int, float)):
            beats[rank] = beat
    return beats


def heartbeat_age(beat: dict, now: float | None = None) -> float:
    """Seconds since ``beat`` was written: by the monotonic clock when it comes from this host since its last boot,
    else by the wall clock (``now``, when given, is a wall-clock time) ([Note: which clock])."""
    if now is None and beat.get("boot") == _BOOT_ID and _BOOT_ID and beat.get("host") == socket.gethostname() \
            and isinstance(beat.get("mono"), (int, float)):
        return time.monotonic() - beat["mono"]
    return (time.time() if now is None else now) - beat.get("time", now or time.time())


def stale_ranks(beats: dict[int, dict], timeout_s: float, exclude: set[int] = frozenset(),
                now: float | None = None) -> list[int]:
    """The ranks whose last heartbeat is older than ``timeout_s`` (at least ``STALE_MIN_S``): stopped or dead."""
    limit = max(timeout_s, STALE_MIN_S)
    return sorted(r for r, h in beats.items() if r not in exclude and heartbeat_age(h, now) > limit)


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` on this host (``R`` running, ``S`` sleeping, ``T`` stopped, ``Z``...),
    None where it cannot be read (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def end_stopped_peers(run_dir: Path, ranks: list[int], world_size: int) -> list[int]:
    """SIGKILL those of ``ranks`` that are stopped processes (``T``) on this host, by their heartbeats; return them.

    For a rank that is failing anyway (its watchdog fired, or its collective timed out on a silent
    peer): a stopped process cannot act on the SIGTERM torchrun's agent sends it, and the agent
    would wait its 30 s grace for it before the job could end. The job is over already, and a
    stopped peer only delays its end.
    """
    beats = read_heartbeats(run_dir, world_size)
    ended = []
    for rank in ranks:
        beat = beats.get(rank, {})
        pid = beat.get("pid")
        if beat.get("host") == socket.gethostname() and isinstance(pid, int) and process_state(pid) in ("T", "t"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                ended.append(rank)
    return ended


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_BOOT_ID = _boot_id()
