"""How the local launcher starts a worker: a fork of a preloaded process, or a fresh interpreter.

``forkserver`` (the default): the first worker starts a fork server (Python's
``multiprocessing`` forkserver) that imports torch and dptrain's training loop once;
every worker is then a fork of it, running ``dptrain.run.main`` with the worker's
environment, working directory and output. A worker starts in milliseconds instead of
the seconds a fresh interpreter takes to import torch (about 1.9 s of CPU per worker
here, which N workers on fewer cores than N pay one after another), the workers share
the libraries' pages, and a worker ends without the half second an interpreter takes to
tear torch down. The server imports but computes nothing, so it has no threads and no
CUDA context to carry into a fork (the reason torch recommends this start method over
plain ``fork``). Within one launcher process (a test suite calling the CLI in process)
later runs reuse the same server.

What a process reads only when it starts comes from the environment the fork server
started in (the launcher's): the C library's (``LD_PRELOAD``, glibc's ``MALLOC_*``) and
torch's import-time settings, of which the worker reads again the two that matter here
(``TORCH_DISTRIBUTED_DEBUG``, ``OMP_NUM_THREADS``). A later run in the same launcher
process (tests) that needs other such settings must use ``exec``.

``exec``: each worker is ``python -m dptrain.run``, exactly what torchrun starts.

Either way a worker sees the same thing: its environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``... and everything the launcher had), the launcher's working directory at
the front of ``sys.path`` (as ``python -m`` puts it there) after ``PYTHONPATH``, and its
output on the launcher's terminal (rank 0) or in ``logs/rank<r>.console``. It also holds a
descriptor of the locked run directory (``lock_fd``, named by ``DPTRAIN_RUN_LOCK_FD``), so
the directory stays locked while any worker lives (``launch.run_lock``, [Note: who holds the
lock]), and it ends when its launcher does (``launch.orphans``).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.reduction
import os
import subprocess
import sys
import threading
from pathlib import Path

from dptrain.launch.orphans import PARENT_ENV, die_with_parent, die_with_pipe
from dptrain.launch.run_lock import FD_ENV
from dptrain.launch.threads import omp_threads
from dptrain.utils.files import open_fd, open_file

__all__ = ["START_METHODS", "PRELOAD", "PAUSED", "FROZEN", "fork_server_preload", "start_worker"]

START_METHODS = ("forkserver", "exec")

# What the fork server imports once: torch, its distributed and compiler front ends (the first
# optimizer imports torch._dynamo: seconds), the checkpoint layouts (torch.distributed.checkpoint, 0.24 s more, which
# `import dptrain.run` leaves to the first save or resume, for a launcher and an exec worker), and the worker's
# code. The test harness uses it too.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "dptrain", "dptrain.run", "dptrain.runner.loop",
           "dptrain.pages.finish", "dptrain.checkpoint.sharded", "dptrain.checkpoint.replicated"]
PAUSED = "dptrain.launch.paused"  # imported before the rest: no collection while they are imported (its docstring)
FROZEN = "dptrain.launch.frozen"  # imported after the rest: they leave the collector's reach, which starts again


def fork_server_preload(extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """What the fork server imports, in order: ``PAUSED``, ``PRELOAD``, then ``extra``, then ``FROZEN``."""
    return [PAUSED, *PRELOAD, *extra, FROZEN]


def start_worker(method: str, argv: list[str], env: dict[str, str], console: Path | tuple[int, int] | None,
                 preload: tuple[str, ...] = (), module: str = "dptrain.run", lock_fd: int | None = None):
    """Start one worker (``python -m MODULE ARGV``); ``console``: where its output goes (None: ours; a path;
    or the descriptors of its stdout and stderr, pipes of ``launch.output``).

    ``module``: ``dptrain.run`` (a ``dptrain run`` worker) or ``dptrain.launch.script`` (your
    script, for ``dptrain launch``); forked, its ``main(argv)`` is called.

    ``preload``: modules the fork server imports beyond ``PRELOAD`` (a Hugging Face model's:
    seconds each worker would otherwise spend importing them).

    ``lock_fd``: the descriptor of the locked run directory, which the worker holds for its life.

    Returns an object with ``subprocess.Popen``'s ``pid``, ``poll``, ``wait``, ``send_signal``,
    ``kill`` and ``returncode``.
    """
    if method == "exec":
        keep = () if lock_fd is None else (lock_fd,)
        env = dict(env, **{PARENT_ENV: str(os.getpid())}, **({FD_ENV: str(lock_fd)} if keep else {}))
        command = [sys.executable, "-m", module, *argv]
        if isinstance(console, tuple):
            return subprocess.Popen(command, env=env, stdout=console[0], stderr=console[1], pass_fds=keep)
        out = None if console is None else open_file(console, "w")
        try:
            return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    pass_fds=keep)
        finally:
            if out is not None:
                out.close()
    if method != "forkserver":
        raise ValueError(f"start method must be one of {', '.join(START_METHODS)}, got {method!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(fork_server_preload(preload))  # no effect once the server runs (started with its list)
    fds = console if isinstance(console, tuple) else (1, 2)
    output = ("path", str(console)) if isinstance(console, Path) else ("fds", _Fd(fds[0]), _Fd(fds[1]))
    lock = None if lock_fd is None else _Fd(lock_fd)
    proc = ctx.Process(target=_forked_worker, args=(module, argv, env, os.getcwd(), output, lock,
                                                    _Fd(_launcher_alive())), name="dptrain-worker")
    proc.start()
    return _Forked(proc)


_ALIVE: list[int] = []  # this launcher's pipe: [read end, write end]; [Note: a forked worker's launcher]


def _launcher_alive() -> int:
    """The read end of a pipe whose only writer is this process, made once and held for its life."""
    if not _ALIVE:
        _ALIVE.extend(os.pipe())  # not inheritable: no process this one starts holds the write end
    return _ALIVE[0]


# [Note: a forked worker's launcher] A forked worker's parent is the fork server, not the launcher, so
# PR_SET_PDEATHSIG names the server, which ends only after its interpreter's exit (2-3 s with torch loaded; a
# killed launcher's workers trained about 150 steps more). Each worker therefore also holds the read end of
# a pipe that only the launcher can write to: when the launcher dies, however it dies, the kernel closes the
# write end and the worker's watch thread sees the end of file at once (``launch.orphans.die_with_pipe``).
# The pipe is the process's, not one run's: a later run in the same process (a test suite) reuses it.


class _Forked:
    """A forked worker behind ``subprocess.Popen``'s interface.

    Its exit status comes from the fork server through a pipe that must be read once:
    ``poll`` reads it under a lock, ``wait`` only waits for the pipe to be readable.
    """

    def __init__(self, proc: mp.Process):
        self.proc, self.pid = proc, proc.pid
        self._lock = threading.Lock()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._lock:
            return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        mp.connection.wait([self.proc.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"dptrain worker {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended in between
                pass

    def kill(self) -> None:
        self.send_signal(9)


class _Fd:
    """A file descriptor handed to a forked worker (the fork server passes a duplicate over its socket)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _Fd._rebuild, (mp.reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> _Fd:
        return _Fd(dup.detach())


def _forked_worker(module: str, argv: list[str], env: dict[str, str], cwd: str, output: tuple,
                   lock: _Fd | None, launcher: _Fd) -> None:
    """In the fork: become the worker ``python -m MODULE ARGV`` would have been, and run it."""
    _leave_the_fork_server()
    os.environ.clear()
    os.environ.update(env)
    if lock is not None:  # held for the worker's life, never passed on to what it executes
        os.set_inheritable(lock.fd, False)
        os.environ[FD_ENV] = str(lock.fd)
    os.chdir(cwd)
    if output[0] == "path":
        fd = open_fd(Path(output[1]), "w")  # never truncated through a link
        out_fd, err_fd = fd, fd
    else:
        out_fd, err_fd = output[1].fd, output[2].fd
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd} - {1, 2}:
        os.close(fd)
    # as a fresh interpreter would buffer its output: by line on a terminal, by block otherwise
    sys.stdout.reconfigure(line_buffering=os.isatty(1))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [cwd]
    sys.path[:0] = [p for p in dict.fromkeys(paths) if p not in sys.path]
    sys.argv = [sys.executable, "-m", module, *argv]
    _settings_read_at_import()
    # the parent is the fork server, which ends with the launcher (_leave_the_fork_server)
    die_with_parent(os.getppid(), f"dptrain-rank{env.get('RANK', '?')}")
    die_with_pipe(launcher.fd)  # the launcher's own death, at once: [Note: a forked worker's launcher]

    code = importlib.import_module(module).main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _settings_read_at_import() -> None:
    """What torch read from the environment when the server imported it, read again from the worker's."""
    import torch
    import torch.distributed as dist

    dist.set_debug_level_from_env()
    threads = omp_threads(os.environ)
    if threads is not None:  # the OpenMP runtime read it when torch was loaded
        torch.set_num_threads(threads)


def _leave_the_fork_server() -> None:
    """Drop the fork server's handles that multiprocessing gives each of its children.

    A child inherits the launcher's end of the pipe the server watches to know that the
    launcher is alive: while any worker held it, a SIGKILLed launcher left the server, and
    with it the workers, running. Without it, the server ends with the launcher and the
    workers with the server (each asks to, ``launch.orphans``). A worker that uses the forkserver
    start method itself then starts a server of its own.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
    for name in ("_forkserver_alive_fd", "_forkserver_address", "_forkserver_pid"):
        if hasattr(server, name):
            setattr(server, name, None)
