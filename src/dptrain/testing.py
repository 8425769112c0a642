"""Run a function on N local ranks: the multi-process harness every distributed test uses.

Each rank is a process of its own, joined into a process group (gloo on CPU) through a
``FileStore`` in a fresh temporary directory, as torch's own multi-process tests do: no
port to pick, so no race between tests running side by side, and no TCP connection to
the store. (Both ends of a ``TCPStore`` connection look the peer's address up in the
DNS; where the resolver leaves a query unanswered, that costs its 5 s timeout:
docs/testing.md.)
Ranks start from a forkserver that has torch preloaded: a rank costs tens of
milliseconds to start instead of the seconds a fresh interpreter needs to import torch.

A distributed bug hangs rather than fails, so the harness never waits forever:

- when a rank raises, the caller gets that rank's traceback (the earliest failure, which
  is the cause; later failures on other ranks are usually its consequences), the other
  ranks get a short grace period to report, and the rest are killed;
- when a rank dies without raising (a gloo abort, a segfault), the exit signal is named;
- when ``timeout`` passes, every rank still running dumps its Python stacks
  (faulthandler) into the error, so the hang shows where each rank was waiting.

Usage::

    def check(rank, world_size, scale):
        t = torch.ones(1) * rank
        dist.all_reduce(t)
        return t.item() * scale

    results = run_on_ranks(check, 3, 2.0)   # [6.0, 6.0, 6.0], one per rank
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dptrain.allocator import tune_cpu_allocator
from dptrain.launch.workers import fork_server_preload

__all__ = ["run_on_ranks", "RankFailedError", "RankTimeoutError"]



class RankFailedError(RuntimeError):
    """A rank raised or died; the message carries the first failing rank's traceback."""


class RankTimeoutError(RuntimeError):
    """Ranks were still running at the timeout; the message carries their stacks."""


@dataclass
class _Report:
    rank: int
    ok: bool
    value: Any  # the return value, or the formatted traceback
    when: float


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    collective_timeout: float | None = None,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    tune_allocator: bool = True,
    start_method: str = "forkserver",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results.

    ``fn`` must be importable by name (defined at module level) and its results
    picklable. The process group is initialised before ``fn`` runs and destroyed
    after. ``timeout`` bounds the whole call; ``collective_timeout`` (default: the same)
    bounds each collective inside it. ``tune_allocator`` applies
    :func:`dptrain.allocator.tune_cpu_allocator` in each rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(fork_server_preload())  # the launcher's list: one server for both
    with tempfile.TemporaryDirectory(prefix="dptrain-ranks-") as tmp:
        procs, readers = [], []
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            spec = _RankSpec(rank, world_size, os.path.join(tmp, "store"), backend, collective_timeout or timeout,
                             threads_per_rank, tune_allocator, os.path.join(tmp, f"stack{rank}.txt"), env or {})
            proc = ctx.Process(target=_rank_main, args=(fn, spec, args, kwargs, writer),
                               name=f"dptrain-rank{rank}", daemon=True)
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        try:
            return _collect(procs, readers, timeout, tmp)
        finally:
            _kill(procs)


@dataclass
class _RankSpec:
    rank: int
    world_size: int
    store_path: str
    backend: str
    timeout: float
    threads: int
    tune_allocator: bool
    stack_path: str
    env: dict[str, str]


def _rank_main(fn, spec: _RankSpec, args, kwargs, writer) -> None:
    os.environ.update(spec.env)
    stack_file = open(spec.stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(spec.threads)
    if spec.tune_allocator:
        tune_cpu_allocator()
    try:
        store = dist.FileStore(spec.store_path, spec.world_size)
        store.set_timeout(timedelta(seconds=spec.timeout))
        dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                                world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.timeout))
        # Every rank's transport is up before any rank runs fn: a rank that returned from init and
        # then from an fn without collectives could exit while a slower rank was still connecting
        # to it, failing that rank's init with "Connection closed by peer" (seen once, pytest -n 2).
        dist.barrier()
        value = fn(spec.rank, spec.world_size, *args, **kwargs)
        payload = _Report(spec.rank, True, value, time.time())
        try:
            data = pickle.dumps(payload)
        except Exception:
            data = pickle.dumps(_Report(spec.rank, False, traceback.format_exc(), time.time()))
    except BaseException:
        data = pickle.dumps(_Report(spec.rank, False, traceback.format_exc(), time.time()))
    writer.send_bytes(data)
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _collect(procs, readers, timeout: float, tmp: str) -> list[Any]:
    deadline = time.monotonic() + timeout
    reports: dict[int, _Report] = {}
    first_failure_at = None
    pending = {r: (procs[r], readers[r]) for r in range(len(procs))}
    while pending:
        now = time.monotonic()
        if first_failure_at is not None and now > first_failure_at + 2.0:
            break  # grace period over: the rest are stuck behind the failure
        if now > deadline:
            raise RankTimeoutError(_timeout_message(pending, reports, timeout, tmp))
        waitables = [x for _, (p, rd) in pending.items() for x in (rd, p.sentinel)]
        ready = mp.connection.wait(waitables, timeout=0.5)
        for rank, (proc, reader) in list(pending.items()):
            if reader in ready or proc.sentinel in ready:
                report = _read_report(rank, proc, reader)
                if report is None:
                    continue
                reports[rank] = report
                del pending[rank]
                if not report.ok and first_failure_at is None:
                    first_failure_at = time.monotonic()
    failures = sorted((r for r in reports.values() if not r.ok), key=lambda r: r.when)
    if failures or pending:
        raise RankFailedError(_failure_message(failures, pending, len(procs)))
    return [reports[r].value for r in range(len(procs))]


def _read_report(rank: int, proc, reader) -> _Report | None:
    try:
        if reader.poll():
            return pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        pass
    proc.join(timeout=0.2)
    if proc.exitcode is None:
        return None  # sentinel not ready yet and nothing to read: keep waiting
    return _Report(rank, False, f"rank {rank} died without a Python exception: "
                                f"{_describe_exit(proc.exitcode)}", time.time())


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _failure_message(failures: list[_Report], pending, world_size: int) -> str:
    lines = []
    if failures:
        first = failures[0]
        lines.append(f"rank {first.rank} of {world_size} failed first:\n{first.value}")
        for other in failures[1:]:
            last = other.value.strip().splitlines()[-1] if other.value.strip() else "?"
            lines.append(f"rank {other.rank} also failed: {last}")
    if pending:
        lines.append(f"ranks {sorted(pending)} were still running and were killed")
    return "\n".join(lines)


def _timeout_message(pending, reports, timeout: float, tmp: str) -> str:
    for proc, _ in pending.values():
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    lines = [f"timed out after {timeout:.0f}s; ranks {sorted(pending)} still running "
             f"(finished: {sorted(reports)})"]
    for rank in sorted(pending):
        with open(os.path.join(tmp, f"stack{rank}.txt")) as f:
            stack = f.read().strip() or "(no stack dumped)"
        lines.append(f"--- rank {rank} stacks ---\n{stack}")
    for rank, report in sorted(reports.items()):
        if not report.ok:
            lines.append(f"--- rank {rank} failed ---\n{report.value}")
    return "\n".join(lines)


def _kill(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=3.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=3.0)
