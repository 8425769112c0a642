"""Run N workers on this machine: the default for ``dptrain run --nproc N``.

Each worker is ``python -m dptrain.run`` with torchrun's environment variables set, so a
worker cannot tell this launcher from torchrun. The launcher owns the job's lifetime:

- rank 0 writes to the terminal; every rank also logs to ``logs/rank<r>.log``;
- when a rank fails, the others get a few seconds to fail too (a dead peer ends their
  collectives quickly), then are terminated; the *first* failure's traceback is shown
  first, since later failures are usually its consequences;
- Ctrl-C reaches every worker (same process group); they stop, and the launcher exits
  130 after giving stragglers a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dptrain.launch.rendezvous import free_port

__all__ = ["launch_local", "error_file"]

GRACE_S = 5.0


def error_file(run_dir: Path, rank: int) -> Path:
    """Where a worker records the traceback that ended it (read by the launcher)."""
    return run_dir / "logs" / f"rank{rank}.error.json"


def launch_local(nproc: int, worker_args: list[str], run_dir: Path, timeout_s: float) -> int:
    """Start ``nproc`` workers, wait for them, return the job's exit code."""
    port = free_port()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DPTRAIN_LAUNCHER="local")
        console = None if rank == 0 else open(logs / f"rank{rank}.console", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "dptrain.run", *worker_args], env=env,
                                      stdout=console, stderr=subprocess.STDOUT if console else None))
    try:
        return _supervise(procs, run_dir, timeout_s)
    except KeyboardInterrupt:
        _stop(procs, grace=GRACE_S * 2)
        print("\ninterrupted: workers stopped", file=sys.stderr)
        return 130


def _supervise(procs: list[subprocess.Popen], run_dir: Path, timeout_s: float) -> int:
    first_failure = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return 0
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and first_failure is None:
            first_failure = time.monotonic()
        if first_failure is not None and (all(c is not None for c in codes)
                                          or time.monotonic() - first_failure > min(GRACE_S, timeout_s)):
            _stop(procs, grace=GRACE_S)
            _report_failure(procs, run_dir)
            return next((c for c in (p.returncode for p in procs) if c == 2), 1)
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _report_failure(procs: list[subprocess.Popen], run_dir: Path) -> None:
    records = []
    for rank, p in enumerate(procs):
        path = error_file(run_dir, rank)
        if path.exists():
            record = json.loads(path.read_text())
            records.append((record["time"], rank, record["traceback"]))
        elif p.returncode not in (0, None, -signal.SIGTERM, -signal.SIGKILL):
            records.append((float("inf"), rank, f"exited with {_describe(p.returncode)} and no Python "
                                                f"traceback; see {run_dir / 'logs' / f'rank{rank}.console'}"))
    records.sort()
    if not records:
        print("error: a worker failed without reporting why; see the logs in "
              f"{run_dir / 'logs'}", file=sys.stderr)
        return
    _, rank, text = records[0]
    print(f"\nerror: rank {rank} failed first:\n{text.rstrip()}", file=sys.stderr)
    for _, other, text in records[1:]:
        last = text.strip().splitlines()[-1] if text.strip() else "?"
        print(f"(rank {other} also failed: {last})", file=sys.stderr)


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
