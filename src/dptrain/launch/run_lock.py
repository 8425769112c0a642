"""One writer per run directory: an advisory ``flock`` on the directory itself, held by every process of the run.

Two runs writing one run directory interleave their metrics, rotate each other's
checkpoints away and resume from a checkpoint being deleted. So whoever writes a run
directory holds its lock from before it writes until it exits: ``dptrain run``'s
launcher (for its local workers, and for torchrun's agent under ``--max-restarts``),
rank 0 of a job started by torchrun or Slurm, and ``dptrain launch``. A second run is
refused at once, naming the holder.

[Note: who holds the lock] The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the run
directory's own descriptor (not on a file in it: removing a file would free it). A
``flock`` belongs to the open file description, so it is held as long as *any* process
holds a descriptor of it. The launcher hands its descriptor to every process it starts
(its workers, forked or exec'd, and torchrun's agent; :data:`FD_ENV` says which number),
so the directory stays locked until the last of them has exited: a launcher killed with
``kill -9`` leaves its workers holding it, and a new run is refused until they are gone
(they end within moments: each dies with its launcher, ``launch.orphans``). The kernel
drops the lock when the last holder exits, however it exits, so a crash never leaves a
directory locked.

The file ``.lock`` beside it holds JSON (pid, host, when it started, the command) for the
messages; a clean release empties it. A free lock whose file still names a holder was
left by a process that died:

- on this host, the lock is taken over with a one-line note;
- on another host (a shared file system, where this host can neither check that process
  nor trust the file system to pass locks between hosts), the run is refused while the
  run's heartbeats (``logs/rank<r>.heartbeat``) are fresh, and otherwise refused with how
  to release it by hand once that run is known to be over.

A worker proves that the lock is its own launcher's, never merely claims it: a local
worker by the inherited descriptor (:func:`inherited`: it must refer to this very
directory), a worker under torchrun's agent by the token of the launcher that holds it
(:data:`TOKEN_ENV`, which the worker removes from its environment once read, so that
nothing it starts inherits the claim).

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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from dptrain.utils.files import UnsafePath, links_in, open_file, pid_alive

__all__ = ["LOCK_NAME", "TOKEN_ENV", "FD_ENV", "RunDirError", "RunDirBusy", "Holder", "RunLock", "acquire",
           "hold_run_dir", "inherited", "keep_inherited"]

LOCK_NAME = ".lock"
TOKEN_ENV = "DPTRAIN_RUN_LOCK"  # the holder's token, for the workers torchrun's agent starts under it
FD_ENV = "DPTRAIN_RUN_LOCK_FD"  # the descriptor of the locked run directory a local worker inherited
FRESH_S = 60.0  # a heartbeat younger than this (or the run's own timeout, if longer) is a run still going


class RunDirError(RuntimeError):
    """The run directory cannot be taken: in use, not writable, or holding what dptrain will not write through."""


class RunDirBusy(RunDirError):
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
    """A held lock: release it (or let every process holding it exit) to free the run directory.

    ``fd`` is the locked directory's descriptor, None when this process's launcher holds the lock.
    """
    path: Path
    holder: Holder
    fd: int | None
    before: tuple[bytes, os.stat_result] | None = None  # the file as it was, None if this created it

    @property
    def token(self) -> str:
        return self.holder.token

    def release(self, undo: bool = False) -> None:
        """Empty the file (a clean release, not a crash), then drop this process's hold.

        ``undo``: the run never started (bad input), so leave the file as it was found:
        its bytes and times put back, or removed if this created it.
        """
        if self.fd is None:
            return
        with contextlib.suppress(OSError, UnsafePath):
            if undo and self.before is None:
                self.path.unlink()
            elif undo:
                _write_file(self.path, self.before[0], self.before[1])
            else:
                _write_file(self.path, b"")
        os.close(self.fd)  # the flock is dropped once the processes this one started have closed theirs too
        self.fd = None


def acquire(run_dir: Path, what: str, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
            environ: Mapping[str, str] | None = None) -> RunLock:
    """Take ``run_dir``'s lock (creating the directory) for ``what`` (e.g. "dptrain run"), or raise
    :class:`RunDirBusy` (in use) or :class:`RunDirError` (cannot be written).

    Returns a lock whose ``fd`` is None when the lock is already held by the launcher that
    started this process, proven by an inherited descriptor (:func:`inherited`) or by the
    token in ``environ[TOKEN_ENV]`` while the holder it names holds the lock.
    """
    environ = os.environ if environ is None else environ
    run_dir = Path(run_dir)
    ours = inherited(run_dir, environ)
    if ours is not None:
        return ours
    fd = _open_dir(run_dir)
    try:
        state = _try_flock(fd)
        previous = _read_holder(run_dir)
        if state == "busy":
            if previous is not None and environ.get(TOKEN_ENV) == previous.token:
                os.close(fd)
                return RunLock(run_dir / LOCK_NAME, previous, None)  # our own launcher's (torchrun's workers)
            raise RunDirBusy(_busy_message(run_dir, previous))
        _check_stale(run_dir, previous, log, flock_works=state == "taken")
        _check_links(run_dir)
        holder = Holder(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), what)
        before = _write_holder(run_dir, holder)
        return RunLock(run_dir / LOCK_NAME, holder, fd, before)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def inherited(run_dir: Path, environ: Mapping[str, str]) -> RunLock | None:
    """The lock this process inherited from its launcher, if ``environ[FD_ENV]`` names a descriptor of this very
    directory (the same device and inode); None otherwise (a claim alone proves nothing)."""
    try:
        fd = int(environ.get(FD_ENV, ""))
        held, here = os.fstat(fd), os.stat(run_dir)
    except (ValueError, OSError):
        return None
    if (held.st_dev, held.st_ino) != (here.st_dev, here.st_ino):
        return None
    holder = _read_holder(run_dir) or Holder(os.getppid(), socket.gethostname(), "?", "its launcher")
    return RunLock(Path(run_dir) / LOCK_NAME, holder, None)


def keep_inherited(environ: Mapping[str, str]) -> None:
    """In a worker's entry point: hold the inherited lock descriptor for this process alone (close-on-exec), so
    that what the worker executes does not hold the run directory after it ends."""
    with contextlib.suppress(ValueError, OSError):
        os.set_inheritable(int(environ.get(FD_ENV, "")), False)


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, what: str = "dptrain launch",
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Iterator[RunLock]:
    """``with hold_run_dir(run_dir, "dptrain launch"):`` the run directory is this process's until the block ends."""
    lock = acquire(run_dir, what, log)
    try:
        yield lock
    finally:
        lock.release()


def _open_dir(run_dir: Path) -> int:
    """The run directory's descriptor (created if missing), or :class:`RunDirError` saying why it cannot be."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileExistsError, NotADirectoryError):
        raise RunDirError(f"the run directory {run_dir} cannot be created: it, or a directory above it, is a file. "
                          "Choose another --run-dir") from None
    except OSError as e:
        raise RunDirError(f"the run directory {run_dir} cannot be used ({e.strerror}). Choose another --run-dir, "
                          "or make it writable") from None


LINK_FREE = ("logs",)  # besides the top level: where dptrain writes files of fixed names, and no link belongs


def _check_links(run_dir: Path) -> None:
    """Refuse a run directory with a symbolic link where dptrain writes: at its top level, or in ``logs/`` (a
    link there would make the run write, truncate or read the file it points to). A link under
    ``checkpoints/`` is not a checkpoint, and is left alone (``dptrain.checkpoint.files.scan_checkpoints``)."""
    links = links_in(run_dir) + [link for sub in LINK_FREE if not (run_dir / sub).is_symlink()
                                 for link in links_in(run_dir / sub)]
    if links:
        shown = "; ".join(f"{p} -> {os.readlink(p)}" for p in links[:5]) + (" ..." if len(links) > 5 else "")
        raise RunDirError(f"the run directory {run_dir} holds symbolic links where dptrain writes ({shown}); it "
                          "writes only files of its own there and never through a link. Remove the links, or "
                          "choose another --run-dir")


def _try_flock(fd: int) -> str:
    """The outcome: taken, busy (another process holds it) or unsupported (a file system without flock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "taken"
    except BlockingIOError:
        return "busy"
    except OSError as e:  # then the JSON and the heartbeats alone decide (_check_stale)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return "unsupported"
        raise


def _read_holder(run_dir: Path) -> Holder | None:
    """The holder the file names, or None when it is missing, empty (released cleanly) or unreadable."""
    try:
        with open_file(run_dir / LOCK_NAME, "rb") as f:
            fields = json.loads(f.read(1 << 16))
        return Holder(int(fields["pid"]), str(fields["host"]), str(fields["started"]), str(fields["command"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_holder(run_dir: Path, holder: Holder) -> tuple[bytes, os.stat_result] | None:
    """Write ``holder`` into ``.lock`` (never through a link); return the file as it was (None: it was created)."""
    path = run_dir / LOCK_NAME
    try:
        existed = os.path.lexists(path)
        with open_file(path, "r+b") as f:
            before = (f.read(1 << 16), os.fstat(f.fileno())) if existed else None
        _write_file(path, (json.dumps(asdict(holder)) + "\n").encode())
        return before
    except UnsafePath as e:
        raise RunDirError(f"{e} (it is where the run directory's lock file goes)") from None
    except OSError as e:
        raise RunDirError(f"the run directory {run_dir} cannot be written ({path}: {e.strerror}). Choose another "
                          "--run-dir, or make it writable") from None


def _write_file(path: Path, data: bytes, times: os.stat_result | None = None) -> None:
    with open_file(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        if times is not None:
            os.utime(f.fileno(), ns=(times.st_atime_ns, times.st_mtime_ns))


def _check_stale(run_dir: Path, previous: Holder | None, log: Callable[[str], None], flock_works: bool) -> None:
    """The lock was free. Refuse while the run's heartbeats say it still runs elsewhere; else take over a dead
    holder's lock with a note."""
    fresh = _fresh_heartbeats(run_dir)
    here = socket.gethostname()
    elsewhere = {r: b for r, b in fresh.items() if b.get("host", here) != here or not flock_works}
    if elsewhere:
        beats = ", ".join(f"rank {r} ({b.get('host', '?')}, {b['age_s']:.0f} s ago)" for r, b in sorted(elsewhere.items()))
        raise RunDirBusy(f"the run directory {run_dir} belongs to a run that is still beating: heartbeats of {beats} "
                         f"in {run_dir / 'logs'}, which this host cannot check. Wait for that run to end, stop it, "
                         "or use another --run-dir")
    if previous is None or previous.pid == os.getpid() and previous.host == here:
        return
    if previous.host != here:
        raise RunDirBusy(
            f"the run directory {run_dir} was locked by {previous.describe()}, and this host cannot tell whether "
            f"that process still runs (its heartbeats in {run_dir / 'logs'} are not fresh). Once you know that run "
            f"is over, empty the lock file (: > {run_dir / LOCK_NAME}) and start again; otherwise wait for it, or "
            "use another --run-dir")
    if not flock_works and pid_alive(previous.pid):  # without flock, a live pid is taken to hold it
        raise RunDirBusy(_busy_message(run_dir, previous))
    log(f"note: taking over the lock of {run_dir}: its holder, {previous.describe()}, is gone")


def _fresh_heartbeats(run_dir: Path) -> dict[int, dict]:
    """The heartbeats in ``run_dir/logs`` written lately by a process not known to be gone (their age added).

    A heartbeat from this host whose pid is not alive is not fresh, whatever its age: a crashed run may
    be taken over at once. One from another host counts while younger than its run's timeout (at least
    ``FRESH_S``).
    """
    fresh = {}
    here = socket.gethostname()
    logs = Path(run_dir) / "logs"
    try:
        names = os.listdir(logs)
    except OSError:
        return fresh
    for name in names:
        if not (name.startswith("rank") and name.endswith(".heartbeat")) or not name[4:-10].isdigit():
            continue
        try:
            beat = json.loads(open_file(logs / name, "rb").read(4096))
            age = time.time() - float(beat["time"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if beat.get("phase") == "exited" or age > max(FRESH_S, float(beat.get("timeout_s") or 0)):
            continue
        if beat.get("host", here) == here and not pid_alive(int(beat.get("pid", 0))):
            continue
        fresh[int(name[4:-10])] = dict(beat, age_s=age)
    return fresh


def _busy_message(run_dir: Path, holder: Holder | None) -> str:
    if holder is None:
        who = f"another process (its lock file {run_dir / LOCK_NAME}, which would name it, is empty or missing)"
    elif holder.host == socket.gethostname() and not pid_alive(holder.pid):
        who = (f"the processes that {holder.describe()} started: that launcher has exited and its workers are "
               "still ending (they die with it)")
    else:
        who = holder.describe()
    kill = f" (kill {holder.pid})" if holder is not None and pid_alive(holder.pid) else ""
    return (f"the run directory {run_dir} is in use by {who}; two runs in one directory would overwrite each "
            f"other's checkpoints and metrics. Wait for it to finish, stop it{kill}, or use another --run-dir")
    return True
