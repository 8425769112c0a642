"""Text that is on every machine: the Python standard library's own source code.

No download, no licence question, and it is real text with structure (code, comments,
docstrings). Files are read in sorted order, so a given Python version always gives the
same bytes; different Python versions give slightly different corpora.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = ["stdlib_corpus"]


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's top-level .py files, as uint8 -> int64."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < max_bytes:
        raise ValueError(f"the standard library at {stdlib} has only {len(blob):,} bytes of .py source; "
                         f"ask for corpus_bytes <= {len(blob)}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
