"""One writer per run directory: an advisory ``flock`` on ``<run_dir>/.lock``, held for the whole run.

Two runs writing one run directory interleave their metrics, rotate each other's
checkpoints away and resume from a checkpoint being deleted. So whoever writes a run
directory holds its lock from before it writes until it exits: ``dptrain run``'s
launcher (for its local workers, and for torchrun's agent under ``--max-restarts``),
rank 0 of a job started by torchrun or Slurm, and ``dptrain launch``. A second run is
refused at once, naming the holder.

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the file ``.lock``: the kernel drops it
when its holder exits, however it exits (``kill -9`` included), so a crash never leaves
a directory locked. The file also holds JSON (pid, host, when it started, the command)
for the message; a clean release empties it. So a free lock whose file still names a
holder was left by a process that died:

- on this host, the lock is taken over with a one-line note;
- on another host (a shared file system), this host cannot tell whether that process
  still runs, nor trust that the file system passes locks between hosts: the run is
  refused with how to remove the lock by hand.

A launcher's workers must not refuse their own launcher's lock: the holder exports its
token (``DPTRAIN_RUN_LOCK=<host>:<pid>:<started>``) to them, and :func:`acquire` given a
run directory whose lock carries that token returns without taking it.

No torch here: the launchers import none.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["LOCK_NAME", "TOKEN_ENV", "RunDirBusy", "Holder", "RunLock", "acquire", "hold_run_dir"]

LOCK_NAME = ".lock"
TOKEN_ENV = "DPTRAIN_RUN_LOCK"  # the holder's token, exported to the workers it starts


class RunDirBusy(RuntimeError):
    """The run directory is locked by another run (or by one this host cannot check)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run directory: what the lock file's JSON says."""
    pid: int
    host: str
    started: str
    command: str

    @property
    def token(self) -> str:
        return f"{self.host}:{self.pid}:{self.started}"

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started} ({self.command})"


@dataclass
class RunLock:
    """A held lock: release it (or let the process exit) to free the run directory."""
    path: Path
    holder: Holder
    fd: int | None
    before: tuple[bytes, os.stat_result] | None = None  # the file as it was, None if this created it

    @property
    def token(self) -> str:
        return self.holder.token

    def release(self, undo: bool = False) -> None:
        """Empty the file (a clean release, not a crash), then drop the lock.

        ``undo``: the run never started (bad input), so leave the file as it was found:
        its bytes and times put back, or removed if this created it. (A process that
        opened it in the instant before the removal could then lock a file no longer
        there; the window is a few microseconds, and only on a refusal.)
        """
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if undo and self.before is None:
                self.path.unlink()
            elif undo:
                _write_bytes(self.fd, self.before[0])
                os.utime(self.fd, ns=(self.before[1].st_atime_ns, self.before[1].st_mtime_ns))
            else:
                os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def acquire(run_dir: Path, what: str, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
            environ: dict[str, str] | None = None) -> RunLock:
    """Take ``run_dir``'s lock (creating the directory) for ``what`` (e.g. "dptrain run"), or raise :class:`RunDirBusy`.

    Returns a lock whose ``fd`` is None when the lock is already held by the launcher that
    started this process (``environ[TOKEN_ENV]`` matches the file's token).
    """
    environ = os.environ if environ is None else environ
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    existed = path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        state = _try_flock(fd)
        previous = _read_holder(fd)
        if state == "busy":
            if previous is not None and previous.token == environ.get(TOKEN_ENV):
                os.close(fd)
                return RunLock(path, previous, None)  # our own launcher's
            raise RunDirBusy(_busy_message(run_dir, previous))
        _check_stale(run_dir, previous, log, flock_works=state == "taken")
        before = (_read_bytes(fd), os.fstat(fd)) if existed else None
        holder = Holder(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), what)
        _write_bytes(fd, (json.dumps(asdict(holder)) + "\n").encode())
        return RunLock(path, holder, fd, before)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, what: str = "dptrain launch",
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Iterator[RunLock]:
    """``with hold_run_dir(run_dir, "dptrain launch"):`` the run directory is this process's until the block ends."""
    lock = acquire(run_dir, what, log)
    try:
        yield lock
    finally:
        lock.release()


def _try_flock(fd: int) -> str:
    """The outcome: taken, busy (another process holds it) or unsupported (a file system without flock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "taken"
    except BlockingIOError:
        return "busy"
    except OSError as e:  # then the JSON alone decides (_check_stale)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return "unsupported"
        raise


def _read_holder(fd: int) -> Holder | None:
    """The holder the file names, or None when it is empty (released cleanly) or unreadable."""
    try:
        fields = json.loads(_read_bytes(fd))
        return Holder(int(fields["pid"]), str(fields["host"]), str(fields["started"]), str(fields["command"]))
    except (ValueError, KeyError, TypeError):
        return None


def _read_bytes(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 16)


def _write_bytes(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)
    os.fsync(fd)


def _check_stale(run_dir: Path, previous: Holder | None, log: Callable[[str], None], flock_works: bool) -> None:
    """The lock was free; a holder still named in the file died without releasing it. Take over, or refuse."""
    if previous is None or previous.pid == os.getpid() and previous.host == socket.gethostname():
        return
    if previous.host != socket.gethostname():
        raise RunDirBusy(
            f"the run directory {run_dir} was locked by {previous.describe()}, and this host cannot tell whether "
            f"that process still runs. If it has ended, delete {run_dir / LOCK_NAME} and start again; otherwise "
            "wait for it, or use another --run-dir")
    if not flock_works and _alive(previous.pid):  # without flock, a live pid is taken to hold it
        raise RunDirBusy(_busy_message(run_dir, previous))
    log(f"note: taking over the lock of {run_dir}: its holder, {previous.describe()}, is gone")


def _busy_message(run_dir: Path, holder: Holder | None) -> str:
    who = holder.describe() if holder is not None else "another process (it has not written its name yet)"
    kill = f" (kill {holder.pid})" if holder is not None else ""
    return (f"the run directory {run_dir} is in use by {who}; two runs in one directory would overwrite each "
            f"other's checkpoints and metrics. Wait for it to finish, stop it{kill}, or use another --run-dir")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
