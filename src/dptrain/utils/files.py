"""A run directory's files are dptrain's own: never written or read through a link, never a device or a pipe.

A symbolic link planted where dptrain writes (``ln -sf ~/.bashrc runs/x/logs/rank0.log``)
would make a run append to, truncate or replace the file it points to; a name in a
checkpoint's ``meta.json`` that is absolute, climbs out with ``..``, or is a FIFO or
``/dev/zero`` would make a resume read outside the checkpoint, block forever or read
until memory runs out. So every file dptrain opens in a run or checkpoint directory is
opened here:

- ``O_NOFOLLOW``: a link in the last component is refused (ELOOP), and so is one in a
  component below the directory the caller names (:func:`inside`);
- ``O_NONBLOCK`` while opening, so a FIFO cannot block the open, then a regular-file
  check (``fstat``) on what was actually opened;
- temporary files created fresh (``O_EXCL`` under a random name, :func:`replacing`), so
  nothing that was already there is written.

A refusal is :class:`UnsafePath` (a ``ValueError``: bad input, exit 2, naming the path and
what it is). No torch here: the launchers use it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["UnsafePath", "pid_alive", "open_file", "open_fd", "read_bytes", "inside", "replacing", "remove_stale_temps", "links_in",
           "describe"]

_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "r+": os.O_RDWR | os.O_CREAT}
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")  # what replacing() names its temporaries


class UnsafePath(ValueError):
    """A path dptrain will not open: a link, a device, a pipe, a directory, or a name outside its directory."""


def describe(path: Path) -> str:
    """What is at ``path``, for a message: "a symbolic link to X", "a FIFO", "a directory"..."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.readlink(path)}"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))
    return next((what for test, what in kinds if test(st.st_mode)), "not a regular file")


def _refused(path: Path, why: str = "") -> UnsafePath:
    return UnsafePath(f"{path} is {why or describe(path)}: dptrain opens only regular files of its own there, "
                      "never through a link; remove it (or choose another directory)")


def open_file(path: Path, mode: str = "r", perms: int = 0o644, newline: str | None = None) -> io.IOBase:
    """``open(path, mode)`` without following a link in its last component, and only if it is a regular file.

    ``mode``: ``r``, ``w``, ``a``, ``x`` or ``r+`` (read and write, created if missing), each with an optional
    ``b``; text files are UTF-8 (``newline`` as ``open``'s), line-buffered when appended to.
    """
    binary = "b" in mode
    base = mode.replace("b", "")
    fd = _open_fd(Path(path), _FLAGS[base], perms)
    if binary:
        return os.fdopen(fd, base.replace("x", "w") + "b")
    return os.fdopen(fd, base.replace("x", "w"), encoding="utf-8", newline=newline,
                     buffering=1 if base == "a" else -1)


def open_fd(path: Path, mode: str = "r", perms: int = 0o644) -> int:
    """:func:`open_file`'s checks, returning the raw descriptor (``mode`` without ``b``)."""
    return _open_fd(Path(path), _FLAGS[mode], perms)


def _open_fd(path: Path, flags: int, perms: int = 0o644) -> int:
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, perms)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refused(path) from None
        if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV):
            raise _refused(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refused(path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file at ``path`` (no link followed), refusing one larger than ``limit``."""
    with open_file(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise UnsafePath(f"{path} holds {size:,} bytes, more than the {limit:,} such a file ever needs: "
                             "it is not dptrain's; remove it")
        return f.read()


def inside(root: Path, name: str) -> Path:
    """``root / name`` for a relative ``name`` that stays inside ``root`` through no link, or :class:`UnsafePath`.

    For names read from a file (a checkpoint's ``meta.json``): absolute names, ``..``, empty
    parts, and directories on the way that are links are all refused.
    """
    parts = name.split("/") if isinstance(name, str) else []
    if not name or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        raise UnsafePath(f"{root}: the name {name!r} is not a plain relative path inside it (no absolute paths, "
                         "no '..'): refusing to open what it names")
    path = Path(root)
    for part in parts[:-1]:
        path = path / part
        if not stat.S_ISDIR(_lstat_mode(path)):
            raise _refused(path, describe(path) + " on the way to " + name)
    return path / parts[-1]


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A fresh temporary file beside ``path`` to write; renamed over ``path`` if the block succeeds, removed if not.

    The temporary is created exclusively under a random name (``.<name>.<pid>.<random>.tmp``),
    so it is never an existing file or a link; ``os.replace`` then replaces the name
    ``path`` itself (a link there is replaced, not followed). Temporaries that a killed
    process left beside ``path`` (their pid is gone) are removed first.
    """
    path = Path(path)
    remove_stale_temps(path)
    tmp = _fresh_temp(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _fresh_temp(path: Path) -> Path:
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            os.close(_open_fd(tmp, _FLAGS["x"]))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {path}")


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete the temporaries of ``path`` (:func:`replacing`'s) whose process has ended (a kill mid-write)."""
    removed = []
    try:
        entries = list(os.scandir(Path(path).parent))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m and m["name"] == Path(path).name and not pid_alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one of another user's counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def links_in(directory: Path, depth: int = 1) -> list[Path]:
    """The symbolic links in ``directory``, and in its subdirectories down to ``depth`` levels (not following any)."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        if entry.is_symlink():
            found.append(Path(entry.path))
        elif depth > 1 and entry.is_dir(follow_symlinks=False):
            found += links_in(Path(entry.path), depth - 1)
    return sorted(found)
