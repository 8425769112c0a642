"""A worker that runs your script: ``python -m dptrain.launch.script SCRIPT [ARGS]`` (or ``-m MODULE``).

``dptrain launch`` starts one of these per rank. It runs the script as ``python SCRIPT``
would (``__name__ == "__main__"``, ``sys.argv`` and the script's directory first on
``sys.path``; with ``-m``, as ``python -m MODULE`` would) and adds two things a training
script does not do for itself:

- **the cause of its end, recorded**: an uncaught exception's traceback goes to
  ``<run dir>/logs/rank<r>.error.json`` (and to torchrun's ``TORCHELASTIC_ERROR_FILE``
  under torchrun), which is how the launcher names the rank that failed *first* and
  shows its traceback before the others' "connection reset by peer";
- **torchrun's variables under Slurm**: started by ``srun`` (one task per device) without
  ``RANK`` and ``WORLD_SIZE``, the worker derives them, and ``MASTER_ADDR``/``MASTER_PORT``,
  from Slurm's (:func:`dptrain.launch.rendezvous.detect_worker_env`), so a plain torch
  script's ``init_process_group(init_method="env://")`` works unchanged.

- **a timeout** (``dptrain launch --timeout S``, passed as ``DPTRAIN_TIMEOUT_S``): torch's default
  process-group timeout becomes S for every group the script makes without a timeout of its own
  (:func:`set_default_collective_timeout`), and a heartbeat thread (``launch.heartbeat``) lets
  the launcher see a stopped rank; a script on dptrain's ``Engine`` or ``prepare()`` marks
  progress at each optimizer step, which arms the watchdog (a main thread stuck for S + a few
  seconds ends the rank). torch is then imported before the script runs.

Exit codes are the script's: ``sys.exit(n)`` is ``n``, an uncaught exception 1,
Ctrl-C 130.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

from dptrain.launch.errors import error_summary, write_error_record
from dptrain.launch.local import AGENT_STORE, LOOPBACK
from dptrain.launch.orphans import orphan_guard
from dptrain.launch.run_lock import FD_ENV, TOKEN_ENV, keep_inherited
from dptrain.utils.worker_exit import finish_interpreter

__all__ = ["main", "torchrun_env_from_slurm", "torchrun_env_from_local", "RUN_DIR_ENV"]

RUN_DIR_ENV = "DPTRAIN_RUN_DIR"  # the launch's run directory: logs/ and the error records live there
TIMEOUT_ENV = "DPTRAIN_TIMEOUT_S"  # dptrain launch --timeout
MASTER_ADDR_ENV = "DPTRAIN_MASTER_ADDR"  # dptrain launch --master-addr (torchrun's flag): this job's MASTER_ADDR
MASTER_PORT_ENV = "DPTRAIN_MASTER_PORT"  # ... and --master-port: its MASTER_PORT
LIVE_STORE_ENV = "DPTRAIN_LIVE_STORE"  # dptrain.live.store's, read here without importing torch
WATCHDOG_MARGIN_S = 5.0  # the watchdog's wait beyond the timeout: the collective's own error speaks first

# [Note: how a worker ends] A torch DDP model holds its process group through its C++ reducer.
# Whenever that group is freed, its destructor joins gloo's worker threads; a worker thread
# still releasing its last collective may need the GIL for it. Freed while the interpreter
# runs (the script's globals, dropped when it returns), the destructor holds the GIL and the
# two wait for each other forever: a rank of a plain DDP script never exited, 1 start in 3 on
# a busy machine. Freed by the interpreter's teardown (as after `python SCRIPT`), the worker
# thread is ended when it asks for the GIL, from inside a C++ destructor, and the process
# aborts ("terminate called without an active exception", SIGABRT) after the script has
# finished: both ranks of the same script, once in a clean-clone test run. So what the script
# leaves behind (its globals, or the frames of the exception that ended it) is kept in _KEPT,
# and the worker ends as a multiprocessing child does: the interpreter's exit short of the
# teardown (:func:`dptrain.utils.worker_exit.finish_interpreter`: the script's threads
# joined, its atexit handlers run, the files it left open flushed), then ``os._exit``.
_KEPT: list[object] = []


def torchrun_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for a worker that ``srun`` started, or {} when they are set already (or no Slurm)."""
    if "RANK" in environ or "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return {}
    from dptrain.launch.rendezvous import detect_worker_env  # imports torch: only for srun's workers

    env = detect_worker_env(environ)
    return {"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size), "LOCAL_RANK": str(env.local_rank),
            "LOCAL_WORLD_SIZE": str(env.local_world_size), "MASTER_ADDR": env.master_addr,
            "MASTER_PORT": str(env.master_port)}


def torchrun_env_from_local(environ: dict[str, str]) -> dict[str, str]:
    """The rest of torchrun's variables for a worker of the local launcher, which sets RANK, WORLD_SIZE, ... and
    the per-job ones (ROLE_NAME, TORCHELASTIC_*): one node, one role, and the rendezvous of ``dptrain launch
    --master-addr/--master-port`` when given (``MASTER_ADDR_ENV``, ``MASTER_PORT_ENV``, taken out of the script's
    environment)."""
    env = {"ROLE_RANK": environ.get("RANK", "0"), "ROLE_WORLD_SIZE": environ.get("WORLD_SIZE", "1"),
           "GROUP_WORLD_SIZE": "1"}
    for name, ours in (("MASTER_ADDR", MASTER_ADDR_ENV), ("MASTER_PORT", MASTER_PORT_ENV)):
        if ours in environ:
            env[name] = environ.pop(ours)
    return env


def main(argv: list[str] | None = None) -> int:
    """Run ``argv`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) as this rank's program; return its exit code.

    The caller ends the process with ``os._exit`` on it ([Note: how a worker ends]).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "-m" and len(argv) < 2:
        print("usage: python -m dptrain.launch.script SCRIPT [ARGS...] | -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    orphan_guard(os.environ)  # started by a local launcher as a fresh interpreter: end with it
    keep_inherited(os.environ)
    local = _launcher_only(os.environ)
    os.environ.update(torchrun_env_from_local(os.environ) if local else torchrun_env_from_slurm(os.environ))
    rank = int(os.environ.get("RANK", "0"))
    try:
        _host_loopback_store(os.environ, rank, local)
    except ValueError as e:  # PortInUse: the port is taken (MASTER_PORT)
        print(f"error: {e}", file=sys.stderr)
        return 2
    with _watched(rank):
        code = _run(argv, rank, local)
        finish_interpreter()
    return code


def _launcher_only(environ: dict[str, str]) -> bool:
    """Whether a local launcher started this worker; what only the worker may see leaves the script's environment.

    The script, and whatever it starts (a sweep driver's ``python -m dptrain.run``, a torchrun), must
    not inherit the launcher's claims: a run it starts takes its own run directory's lock, and is
    refused on this launch's (``launch.run_lock``).
    """
    for name in (FD_ENV, TOKEN_ENV):
        environ.pop(name, None)
    return environ.pop("DPTRAIN_LAUNCHER", None) == "local"


@contextlib.contextmanager
def _watched(rank: int):
    """With ``DPTRAIN_TIMEOUT_S``: the collectives' default timeout and this rank's heartbeat around the script."""
    timeout, run_dir = os.environ.get(TIMEOUT_ENV), os.environ.get(RUN_DIR_ENV)
    if not timeout or not run_dir:
        yield
        return
    from dptrain.launch.heartbeat import Heartbeat

    set_default_collective_timeout(float(timeout))
    with Heartbeat(Path(run_dir), rank, int(os.environ.get("WORLD_SIZE", "1")), float(timeout), WATCHDOG_MARGIN_S):
        yield


def _host_loopback_store(environ: dict[str, str], rank: int, local: bool) -> None:
    """Under the local launcher, the job's store on 127.0.0.1 only, whatever the script does.

    A script's ``init_process_group`` (env://) would make rank 0 host torch's store, which
    listens on every interface. Instead rank 0 hosts it here, bound to loopback
    (:func:`dptrain.launch.rendezvous.loopback_store`), and every rank, rank 0 included, is a
    client of it, as torchrun's workers are of their agent's store (``TORCHELASTIC_USE_AGENT_STORE``).
    Rank 0 then imports torch before the script runs; the others do not. A script that
    brings its own store or meets elsewhere (another ``MASTER_ADDR``) is left alone.
    """
    if (not local or environ.get(AGENT_STORE) == "True" or environ.get(LIVE_STORE_ENV)
            or environ.get("MASTER_ADDR") not in LOOPBACK or "MASTER_PORT" not in environ):
        return  # (live recovery: each worker is a group of its own; the job meets at its live store)
    if rank == 0:
        from datetime import timedelta

        from dptrain.launch.rendezvous import detect_worker_env, loopback_store

        timeout = float(environ.get(TIMEOUT_ENV) or 1800)  # torch's default for a store's waits
        _KEPT.append(loopback_store(detect_worker_env(environ), timedelta(seconds=timeout)))
    environ[AGENT_STORE] = "True"


def set_default_collective_timeout(seconds: float) -> None:
    """Make ``seconds`` the timeout of every process group created without one (``init_process_group``,
    ``new_group``).

    torch reads its default from the module attributes ``default_pg_timeout`` (gloo and the others)
    and ``default_pg_nccl_timeout`` of ``torch.distributed.distributed_c10d`` each time a group is
    made. They are not a documented setting, so this one helper is the only place that writes them.
    """
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=seconds)
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
        c10d.default_pg_nccl_timeout = timedelta(seconds=seconds)


def _run(argv: list[str], rank: int, local: bool) -> int:
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
            _KEPT.append(runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
        else:
            script = Path(argv[0])
            sys.argv = [str(script), *argv[1:]]
            _script_dir_first(script)
            _KEPT.append(runpy.run_path(str(script), run_name="__main__"))
        return 0
    except SystemExit as e:
        _KEPT.append(e)
        return _exit_code(e.code)
    except KeyboardInterrupt as e:
        _KEPT.append(e)
        return 130
    except BaseException as e:  # noqa: BLE001 - every end of a worker is recorded for the launcher
        _KEPT.append(e)  # its traceback holds the script's frames and globals
        code = _live_end(e)
        if code is not None:  # live recovery cannot go on, or this worker may not join: one line, no traceback
            record_error(rank, f"error: {e}", error_summary(e))
            print(f"error: {e}", file=sys.stderr)
            return code
        text = _user_traceback(e)
        record_error(rank, text, error_summary(e))
        if rank != 0 or not local:  # rank 0's terminal gets it from the local launcher, first failure first
            print(text, file=sys.stderr, end="")
        return 1


def _live_end(error: BaseException) -> int | None:
    """The exit code of a script's ``dptrain.Live`` error that a restart would not mend, as ``dptrain run``'s: 3
    when live recovery cannot go on (too few workers), 2 when this worker runs another job than the others'."""
    quorum, trust = sys.modules.get("dptrain.live.quorum"), sys.modules.get("dptrain.live.trust")
    if quorum is not None and isinstance(error, quorum.TooFewWorkers):
        return quorum.GIVE_UP_EXIT
    if trust is not None and isinstance(error, trust.JobMismatch):
        return 2
    return None


def record_error(rank: int, text: str, summary: str) -> None:
    """Write this rank's traceback where the launcher (``logs/rank<r>.error.json``) and torchrun look for it."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    write_error_record(Path(run_dir) if run_dir else None, rank, text, summary)


def _script_dir_first(script: Path) -> None:
    """``sys.path`` as ``python SCRIPT`` has it: the script's directory first, and the working directory
    (which ``python -m`` put there for us) gone unless ``PYTHONPATH`` names it."""
    cwd = os.getcwd()
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    for i, entry in enumerate(sys.path):
        if os.path.abspath(entry or ".") == cwd and cwd not in named:
            del sys.path[i]
            break
    sys.path.insert(0, str(script.resolve().parent))


def _user_traceback(error: BaseException) -> str:
    """The traceback from the script's first frame: the runner's and runpy's frames above it are noise."""
    tb = error.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _exit_code(code: object) -> int:
    """``sys.exit``'s argument as a process's exit status: None is 0, a message is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    os._exit(main())  # [Note: how a worker ends]
