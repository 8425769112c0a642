"""Run N workers on this machine: the default for ``dptrain run --nproc N``.

Each worker is ``python -m dptrain.run`` with torchrun's environment variables set, so a
worker cannot tell this launcher from torchrun. The launcher owns the job's lifetime:

- rank 0 writes to the terminal; every rank also logs to ``logs/rank<r>.log``;
- when a rank fails, the others get a few seconds to fail too (a dead peer ends their
  collectives quickly), then are terminated; the root cause's traceback is shown first:
  failures that only report a lost peer ("Connection reset by peer") come after the
  rest, and within each kind the earliest failure (its error record's time, or when its
  process died) comes first;
- Ctrl-C reaches every worker (same process group); they stop, and the launcher exits
  130 after giving stragglers a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dptrain.launch.rendezvous import free_port

__all__ = ["launch_local", "error_file", "PEER_LOST", "TIMED_OUT"]

GRACE_S = 5.0
SETTLE_S = 1.0  # [Note: settle before going on]

# What a rank reports when a *peer* died: a consequence, not a cause.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|remote process exited|Broken pipe|"
                        r"ProcessGroup.*(aborted|terminated)", re.IGNORECASE)


# What a rank reports when a collective waited past ddp.timeout_s.
TIMED_OUT = re.compile(r"timed out|timeout|DistBackendError.*watchdog", re.IGNORECASE)


def error_file(run_dir: Path, rank: int) -> Path:
    """Where a worker records the traceback that ended it (read by the launcher)."""
    return run_dir / "logs" / f"rank{rank}.error.json"


def launch_local(nproc: int, worker_args: list[str], run_dir: Path, timeout_s: float,
                 expendable: set[int] = frozenset()) -> int:
    """Start ``nproc`` workers, wait for them, return the job's exit code.

    The failure of an ``expendable`` rank (a worker of an async parameter-server job)
    does not end the job: it is reported, and the job's exit code is that of the rest.
    """
    port = free_port()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(nproc):
        error_file(run_dir, rank).unlink(missing_ok=True)  # from an earlier attempt in this directory
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DPTRAIN_LAUNCHER="local")
        console = None if rank == 0 else open(logs / f"rank{rank}.console", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "dptrain.run", *worker_args], env=env,
                                      stdout=console, stderr=subprocess.STDOUT if console else None))
    exit_times = [0.0] * nproc
    for rank, proc in enumerate(procs):  # exact exit times, to order failures
        threading.Thread(target=_note_exit, args=(proc, exit_times, rank), daemon=True).start()
    try:
        return _supervise(procs, exit_times, run_dir, timeout_s, expendable)
    except KeyboardInterrupt:
        _stop(procs, grace=GRACE_S * 2)
        print("\ninterrupted: workers stopped", file=sys.stderr)
        return 130


def _note_exit(proc: subprocess.Popen, exit_times: list[float], rank: int) -> None:
    proc.wait()
    exit_times[rank] = time.time()


def _supervise(procs: list[subprocess.Popen], exit_times: list[float], run_dir: Path, timeout_s: float,
               expendable: set[int]) -> int:
    first_failure, survived, pending = None, set(), {}
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r in expendable - survived:  # [Note: settle before going on]
            if codes[r] not in (None, 0):
                since = pending.setdefault(r, now)
                if first_failure is None and now - since >= SETTLE_S:
                    survived.add(r)
                    del pending[r]
                    print(f"warning: rank {r} exited with {_describe(codes[r])}; the run goes on without it "
                          f"(see {run_dir / 'logs'})", file=sys.stderr)
        if all(c == 0 or r in survived for r, c in enumerate(codes)):
            return 0
        failed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in survived and r not in pending]
        if failed and first_failure is None:
            first_failure = time.monotonic()
        if first_failure is not None and (all(c is not None for c in codes)
                                          or time.monotonic() - first_failure > min(GRACE_S, timeout_s)):
            stopped_at = _stop(procs, grace=GRACE_S)
            if all(p.returncode in (0, 2) for p in procs):
                return 2  # bad input: the workers printed the error themselves
            _report_failure(procs, exit_times, stopped_at, run_dir)
            return 1
        time.sleep(0.2)


# [Note: settle before going on] An expendable rank's death is declared survivable only
# after SETTLE_S with no other failure: when a parameter server dies, its workers end with
# an error at about the same moment, and one of them may exit before the server's death is
# seen. Without the wait, that worker would be reported as lost and survived, just before
# the job fails for the server's death.


def _stop(procs: list[subprocess.Popen], grace: float) -> float:
    """SIGTERM the running workers, SIGKILL them after ``grace``; return when we began."""
    began = time.time()
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
    return began


def _report_failure(procs: list[subprocess.Popen], exit_times: list[float], stopped_at: float,
                    run_dir: Path) -> None:
    records = []
    for rank, p in enumerate(procs):
        path = error_file(run_dir, rank)
        if path.exists():
            record = json.loads(path.read_text())
            text = record["traceback"]
            last = text.strip().splitlines()[-1] if text.strip() else "?"
            records.append((bool(PEER_LOST.search(text)), record["time"], rank, text, record.get("summary", last)))
        elif p.returncode not in (0, None) and not (p.returncode < 0 and exit_times[rank] >= stopped_at):
            # died on its own (a signal we did not send, or no traceback recorded)
            died = (f"exited with {_describe(p.returncode)} and no Python traceback; see "
                    f"{run_dir / 'logs' / f'rank{rank}.console'} and {run_dir / 'logs' / f'rank{rank}.log'}")
            records.append((False, exit_times[rank] or float("inf"), rank, died, died))
    records.sort()
    if not records:
        print("error: a worker failed without reporting why; see the logs in "
              f"{run_dir / 'logs'}", file=sys.stderr)
        return
    _, _, rank, text, _ = records[0]
    print(f"\nerror: rank {rank} failed first:\n{text.rstrip()}", file=sys.stderr)
    for _, _, other, _, summary in records[1:]:
        print(f"(rank {other} also failed: {summary})", file=sys.stderr)
    failed = {r for _, _, r, _, _ in records}
    stopped = [r for r, p in enumerate(procs) if r not in failed and p.returncode is not None and p.returncode < 0]
    if stopped and any(TIMED_OUT.search(t) for _, _, _, t, _ in records):
        print(f"rank(s) {stopped} were still running when the others timed out waiting for them, and were "
              f"stopped: the likely cause (a hang, or a rank that stopped calling collectives). Their logs: "
              f"{run_dir / 'logs'}", file=sys.stderr)


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
