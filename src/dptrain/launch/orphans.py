"""No orphans: a process a launcher starts ends when that launcher ends, however it ends (``kill -9`` too).

A worker that outlives its launcher trains on alone, and a second run started in the same
directory would resume beside it. On Linux the kernel can send a signal to a process when
its parent exits (``prctl(PR_SET_PDEATHSIG)``); the process asks for it itself, then checks
that its parent is still the one it expects (the parent may have died before the request).
It covers:

- workers started as fresh interpreters (``--start-method exec``): the launcher names itself
  in :data:`PARENT_ENV`, and the worker's entry point calls :func:`die_with_parent`;
- forked workers: their parent is the fork server, which ends with the launcher
  (``launch.workers``), but only after its interpreter's exit, which took 2-3 s with torch
  imported (a killed launcher's workers trained on for about 150 steps). So a forked worker
  also watches a pipe whose only writer is its launcher (:func:`die_with_pipe`): the kernel
  closes it when the launcher dies, and the worker ends at once;
- torchrun's agent under ``--max-restarts``: started through ``python -m dptrain.launch.orphans
  PID -- COMMAND...``, which asks for the signal and then becomes COMMAND (the request survives
  ``exec``); the agent, on SIGTERM, stops its own workers.

Elsewhere (not Linux) a no-op; the run directory's lock still keeps a second run out while
any of them lives (``launch.run_lock``, [Note: who holds the lock]).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["PARENT_ENV", "die_with_parent", "die_with_pipe", "orphan_guard", "main"]

PARENT_ENV = "DPTRAIN_PARENT_PID"  # the launcher's pid, for a worker it started as a fresh interpreter
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


def die_with_parent(parent: int, name: str | None = None) -> None:
    """SIGTERM this process when ``parent`` (its parent now) exits; end it at once if ``parent`` is gone already.

    ``name``: shown by top and ``ps -o comm`` (15 bytes at most).
    """
    if sys.platform != "linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to call: the run directory's lock still holds
        return
    if name:
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_pipe(fd: int) -> None:
    """SIGTERM this process when every writer of the pipe whose read end is ``fd`` has closed it (its launcher, the
    only writer, exited, however it ended); a daemon thread waits for that end of file."""
    def watch() -> None:
        try:
            while os.read(fd, 1):  # nothing is ever written: only the end of file returns
                pass
        except OSError:  # the descriptor is bad: nothing to watch, the fork server's end still holds
            return
        os.kill(os.getpid(), signal.SIGTERM)  # as PR_SET_PDEATHSIG would

    os.set_inheritable(fd, False)  # nothing this worker starts holds it
    threading.Thread(target=watch, daemon=True, name="dptrain-launcher-watch").start()


def orphan_guard(environ: dict[str, str]) -> None:
    """In a worker's entry point: die with the launcher that named itself in ``environ[PARENT_ENV]`` (then
    removed, so that nothing this worker starts inherits it)."""
    parent = environ.pop(PARENT_ENV, None)
    if parent and parent.isdigit():
        die_with_parent(int(parent), f"dptrain-rank{environ.get('RANK', '?')}")


def main(argv: list[str] | None = None) -> None:
    """``python -m dptrain.launch.orphans PID -- COMMAND [ARGS...]``: become COMMAND, ending when PID does."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python -m dptrain.launch.orphans PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(2)
    die_with_parent(int(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main()
