"""Where a local worker's output goes: the launcher's terminal, a file, or both with a ``[rank r]`` prefix.

By default rank 0 writes to the terminal as it is and every other rank to
``logs/rank<r>.console``. ``dptrain launch --ranks all`` (or a list) shows the chosen
ranks' lines on the terminal, each prefixed ``[rank r]`` as torchrun's ``--tee`` prefixes
them, stdout to stdout and stderr to stderr, and still copies them to their console
files: a rank's output goes through two pipes to two relay threads of the launcher, which
write each whole line at once, so lines of different ranks never interleave mid-line.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import BinaryIO

from dptrain.utils.files import open_file

__all__ = ["PrefixedOutput", "parse_ranks"]


def parse_ranks(text: str, nproc: int) -> frozenset[int]:
    """``all`` or a comma-separated list of ranks below ``nproc``; a ValueError names what is wrong."""
    if text.strip() == "all":
        return frozenset(range(nproc))
    try:
        ranks = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--ranks takes 'all' or a comma-separated list of ranks (e.g. 0,1), got {text!r}") from None
    outside = sorted(r for r in ranks if not 0 <= r < nproc)
    if not ranks or outside:
        raise ValueError(f"--ranks {text!r}: ranks run from 0 to {nproc - 1} with --nproc {nproc}"
                         + (f"; {outside} is outside" if outside else ""))
    return ranks


class PrefixedOutput:
    """One rank's stdout and stderr relayed to ours, line by line with ``[rank r] ``, and to ``console``."""

    def __init__(self, rank: int, console: Path):
        self.prefix = f"[rank {rank}] ".encode()
        self._out_r, self.out_w = os.pipe()
        self._err_r, self.err_w = os.pipe()
        self._file = open_file(console, "wb")  # never through a link
        self._lock = threading.Lock()  # the console file is shared by the two relays
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Once the worker holds its ends of the pipes: close ours, and relay until the worker's are closed."""
        os.close(self.out_w)
        os.close(self.err_w)
        for read_fd, terminal in ((self._out_r, sys.stdout), (self._err_r, sys.stderr)):
            thread = threading.Thread(target=self._relay, args=(os.fdopen(read_fd, "rb"), terminal), daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the relays to drain what the (ended) worker wrote, then close the console file."""
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:
            self._file.close()

    def _relay(self, source: BinaryIO, terminal) -> None:
        stream = getattr(terminal, "buffer", None)
        with source:
            for line in source:  # a last line without its newline comes through too
                whole = line if line.endswith(b"\n") else line + b"\n"
                if stream is not None:
                    stream.write(self.prefix + whole)
                    stream.flush()
                else:  # a text stream without a buffer (a test's capture)
                    terminal.write((self.prefix + whole).decode(errors="replace"))
                    terminal.flush()
                with self._lock:
                    if not self._file.closed:
                        self._file.write(line)
                        self._file.flush()
