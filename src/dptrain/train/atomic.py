"""Files in a run directory are complete or absent: write beside, then rename over.

``os.replace`` within one directory is atomic on POSIX, so a reader (or a run resumed
after a crash) sees the old file or the new one, never half of one. The temporary name
starts with a dot, so listings of the run directory (the summary) skip it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

__all__ = ["replacing", "write_text_atomic"]


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed over it if the block succeeds, removed if not."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)
