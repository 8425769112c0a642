"""One ``dptrain run`` as a benchmark step: the real command line, its summary and metrics back.

:func:`run_cli` runs a ``dptrain`` command line in this process, as ``subprocess.run``
would in a new one: the same entry point, arguments, working directory and environment,
and its output (the workers' too) captured. Its workers are forked from this process's
fork server (``launch.workers``), started by the first run and kept: a study or a test
suite of many runs pays for importing torch once, not four interpreters per run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

__all__ = ["dptrain_run", "dptrain_command", "run_cli", "toml_value", "Raw", "with_overrides"]


class Raw(str):
    """A value already in ``--set`` syntax (from the command line), passed on as it is."""


def with_overrides(settings: dict[str, object], overrides: list[str]) -> dict[str, object]:
    """``settings`` with each ``KEY=VALUE`` of ``overrides`` (``--set`` syntax, from the command line) on top."""
    out = dict(settings)
    for override in overrides:
        key, _, value = override.partition("=")
        out[key] = Raw(value)
    return out


def toml_value(value) -> str:
    """A Python value as ``--set`` takes it (TOML syntax)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def dptrain_command(nproc: int, settings: dict[str, object], run_dir: Path) -> list[str]:
    """``dptrain run`` on ``nproc`` ranks in ``run_dir``, with ``--set key=value`` for each setting."""
    args = [sys.executable, "-m", "dptrain.cli", "run", "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for key, value in settings.items():
        args += ["--set", f"{key}={toml_value(value)}"]
    return args


def dptrain_run(nproc: int, settings: dict[str, object], run_dir: Path) -> dict:
    """Run ``dptrain run`` with ``--set key=value`` for each setting; returns summary, train records, wall time.

    In this process (:func:`run_cli`): ``wall_s`` is the launcher's, without an interpreter start.
    """
    args = dptrain_command(nproc, settings, run_dir)[3:]  # after `python -m dptrain.cli`
    t0 = time.perf_counter()
    done = run_cli(args)
    if done.returncode != 0:
        raise RuntimeError(f"dptrain run with {settings} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "train": [r for r in records if r.get("kind") == "train"], "wall_s": time.perf_counter() - t0}


def run_cli(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``dptrain ARGS`` in this process; returns what ``subprocess.run(..., capture_output=True, text=True)`` would.

    ``cwd`` and ``env`` (default: this process's) hold during the call and are restored
    after it, with this process's working directory, environment and output.
    """
    from dptrain.cli import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd or saved_cwd)
        try:
            with _output_to(out, err):
                code = _exit_code(main, args)
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        return subprocess.CompletedProcess(["dptrain", *args], code, _read(out), _read(err))


def _exit_code(main, args: list[str]) -> int:
    """What the process would have exited with: the command's SystemExit, or 1 with the traceback printed."""
    try:
        main.main(args, prog_name="dptrain", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


@contextlib.contextmanager
def _output_to(out, err):
    """File descriptors 1 and 2 (where forked workers write) and ``sys.stdout``/``sys.stderr`` into ``out``, ``err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    streams = [io.TextIOWrapper(os.fdopen(os.dup(fd), "wb"), line_buffering=True) for fd in (1, 2)]
    try:
        with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
            yield
    finally:
        for stream in streams:
            stream.close()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _read(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")
