"""How a worker records the cause of its end, and how the launcher reads it back.

A worker that fails writes ``logs/rank<r>.error.json`` (its traceback, a one-line summary,
and the ranks its roll call found silent), and torchrun's ``TORCHELASTIC_ERROR_FILE`` when
it runs under torchrun; the launcher reads them to name the rank that failed first. The
records are read defensively: a full disk leaves them empty or cut short.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from dptrain.utils.files import UnsafePath, open_file

__all__ = ["error_file", "write_error_record", "read_error_record", "error_summary"]


def error_file(run_dir: Path, rank: int) -> Path:
    """Where a worker records the traceback that ended it (read by the launcher)."""
    return run_dir / "logs" / f"rank{rank}.error.json"


def write_error_record(run_dir: Path | None, rank: int, text: str, summary: str, silent: list[int] = ()) -> None:
    """A worker's record of its end, read by the launcher: the traceback, a one-line summary, and the ranks
    its roll call found silent; also written to torchrun's ``TORCHELASTIC_ERROR_FILE``, from which torchrun
    reports the first failure."""
    record = {"rank": rank, "time": time.time(), "traceback": text, "summary": summary,
              "silent_ranks": list(silent)}
    if run_dir is not None:
        path = error_file(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError, UnsafePath), open_file(path, "w") as f:  # a full disk: the console
            f.write(json.dumps(record))                                            # still has the traceback
    torchrun_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if torchrun_file:
        Path(torchrun_file).write_text(json.dumps({"message": {"message": text.strip().splitlines()[-1],
                                                               "extraInfo": {"py_callstack": text,
                                                                             "timestamp": str(int(time.time()))}}}))


def error_summary(error: BaseException) -> str:
    """``module.Type: first line of the message``, then any notes (the roll call's): what the launcher lists."""
    message = str(error).strip().splitlines()
    head = type(error).__qualname__ + (f": {message[0]}" if message else "")
    if type(error).__module__ not in ("builtins", "__main__"):
        head = f"{type(error).__module__}.{head}"
    return "; ".join([head, *getattr(error, "__notes__", [])])


def read_error_record(run_dir: Path, rank: int) -> dict | None:
    """A rank's error record, or None when it has none or it cannot be read: a full disk leaves an empty or
    truncated file, and the launcher then falls back to the rank's console and log (never a crash)."""
    try:
        with open_file(error_file(run_dir, rank), "rb") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):  # UnsafePath is a ValueError: a link is not a record
        return None
    if not isinstance(record, dict) or not isinstance(record.get("traceback"), str):
        return None
    return record
