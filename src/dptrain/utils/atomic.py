"""Files in a run directory are complete or absent: write beside, then rename over.

``os.replace`` within one directory is atomic on POSIX, so a reader (or a run resumed
after a crash) sees the old file or the new one, never half of one. The temporary is a
fresh file under a hidden random name (:func:`dptrain.utils.files.replacing`: never an
existing file or a link), so listings of the run directory (the summary) skip it.

Deleting works the same way backwards (:func:`remove_tree`): a directory is first
renamed to a hidden trash name beside it, then removed; nobody ever sees a half-deleted
directory under its real name, and one that was found complete stays so or is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dptrain.utils.files import open_file, replacing

__all__ = ["replacing", "replacing_dir", "write_text_atomic", "remove_tree", "TRASH"]

TRASH = ".trash"  # the infix of a directory being deleted: .<name>.trash-<pid>


@contextlib.contextmanager
def replacing_dir(path: Path, replace: bool = False) -> Iterator[Path]:
    """A new staging directory beside ``path`` to fill; renamed to ``path`` if the block succeeds, removed if not.

    Its files become readable by everyone (0644, the directory 0755). ``replace``: an
    existing ``path`` is removed first (otherwise the rename fails on a non-empty one).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield staging
        for item in staging.iterdir():
            item.chmod(0o644)
        staging.chmod(0o755)
        if replace and path.exists():
            remove_tree(path)
        staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    with replacing(path) as tmp, open_file(tmp, "w") as f:
        f.write(text)


def remove_tree(path: Path) -> bool:
    """Rename ``path`` to ``.<name>.trash-<pid>`` beside it, then delete that; False if ``path`` was already gone.

    The rename is atomic, so a concurrent reader finds the directory whole or not at
    all; another process deleting the same tree at once is not an error (whoever
    renames first deletes it).
    """
    trash = path.with_name(f".{path.name}{TRASH}-{os.getpid()}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return False
    if trash.is_symlink() or not trash.is_dir():  # a link (never followed) or a file where a directory was expected
        trash.unlink()
        return True
    shutil.rmtree(trash, ignore_errors=True)
    if trash.exists():  # not a concurrent deletion (that leaves nothing): raise what stopped it
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(trash)
    return True
