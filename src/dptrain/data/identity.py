"""What a run's data was: a cheap fingerprint of each data file, recorded in checkpoints and checked on resume.

A resumed run continues from a step, an epoch and a position in the data order; on other
data the same positions name other samples, and the run silently trains on something
else. Each data file is described by its size, its token count, its modification time
and a SHA-256 of sampled blocks: the first and last 64 KiB block and 14 evenly spaced
between them (the whole file when it is at most 16 blocks). Reading 1 MiB is O(1) in
the file's size, so a 10 GB ``train.bin`` costs what a small one does. The trade-off: an
edit confined to the bytes between the sampled blocks that keeps the size is not seen.
A changed modification time alone (a copy, a ``touch``) is not a change.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["BLOCK", "BLOCKS", "file_identity", "data_identity", "data_changes"]

BLOCK = 1 << 16  # bytes per sampled block
BLOCKS = 16  # first, last and 14 evenly spaced


def sampled_sha256(path: Path, size: int) -> str:
    """SHA-256 of the size and ``BLOCKS`` blocks of ``BLOCK`` bytes at evenly spaced offsets (all of a small file)."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= BLOCK * BLOCKS:
            h.update(f.read())
            return h.hexdigest()
        last = size - BLOCK
        for k in range(BLOCKS):
            f.seek(k * last // (BLOCKS - 1))  # k = 0: the first block; k = BLOCKS - 1: the last
            h.update(f.read(BLOCK))
    return h.hexdigest()


def file_identity(path: Path, itemsize: int = 0) -> dict:
    """One file's record: path, bytes, tokens (``itemsize`` bytes each; omitted if 0), mtime_ns, sampled sha256."""
    st = Path(path).stat()
    record = {"path": str(Path(path).resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
              "sampled_sha256": sampled_sha256(Path(path), st.st_size)}
    if itemsize:
        record["tokens"] = st.st_size // itemsize
    return record


def data_identity(files: dict[str, tuple[Path, int]]) -> dict:
    """``{name: file_identity}`` for ``{name: (path, itemsize)}``: what a checkpoint records of its data."""
    return {name: file_identity(path, itemsize) for name, (path, itemsize) in files.items()}


def data_changes(before: dict, now: dict) -> list[str]:
    """What differs between two :func:`data_identity` records, one phrase per file; empty if the data is the same.

    A file is the same when its size and sampled hash are; a path or modification time that
    moved is not a change (a copied or re-mounted directory)."""
    changes = []
    for name in sorted(set(before) | set(now)):
        old, new = before.get(name), now.get(name)
        if old is None or new is None:
            changes.append(f"{name} {'was not' if old is None else 'is no longer'} part of the run's data")
        elif old.get("bytes") != new.get("bytes"):
            changes.append(f"{new['path']}: {_size(old)} before, {_size(new)} now")
        elif old.get("sampled_sha256") != new.get("sampled_sha256"):
            changes.append(f"{new['path']}: same size ({_size(new)}) but other contents (sampled blocks differ)")
    return changes


def _size(record: dict) -> str:
    if "tokens" in record:
        return f"{record['tokens']:,} tokens"
    return f"{record['bytes']:,} bytes"
