"""The one handle for asynchronous work (dptrain.comm.work.Work), and the DDP engine's one way out of a bucket."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.comm.progress import ProgressThread
from dptrain.comm.work import Work
from dptrain.ddp.comm_hooks import SumAllReduce
from dptrain.testing import run_on_ranks

pytestmark = pytest.mark.timeout(120)


def test_finishing_steps_run_once_in_order_on_the_first_wait() -> None:
    ran = []
    work = Work.completed(lambda: ran.append("finish") or "first").then(lambda: ran.append("then") or "result")
    assert ran == []  # nothing runs before wait()
    assert work.wait() == "result"
    assert work.wait() == "result"
    assert ran == ["finish", "then"]


def test_a_completed_work_is_done_and_stamped_before_it_is_waited_for() -> None:
    work = Work.completed(lambda: 7)
    assert work.is_completed() and work.completed_at is not None
    assert work.wait() == 7


def test_a_progress_threads_error_is_raised_by_every_wait_and_finish_never_runs() -> None:
    finished = []
    thread = ProgressThread("test-work-error")

    def fail() -> None:
        raise ValueError("round 3 failed")

    work = thread.submit(fail, lambda: finished.append(1))
    for _ in range(2):
        with pytest.raises(ValueError, match="round 3 failed"):
            work.wait()
    assert finished == [] and work.completed_at is not None


def test_a_progress_thread_job_completes_in_its_thread_and_is_timed_exactly() -> None:
    release = threading.Event()
    thread = ProgressThread("test-work-timing")
    work = thread.submit(release.wait, lambda: "done")
    assert not work.is_completed() and work.completed_at is None
    release.set()
    assert work.wait() == "done" and work.is_completed()
    assert work.completed_at is not None


def _timed_and_untimed(rank: int, world_size: int) -> list:
    from dptrain import comm

    out = []
    for timed in (True, False):
        t = torch.full((1000,), float(rank))
        work = comm.all_reduce(t, async_op=True, validate=False, timed=timed)
        result = work.wait()
        out.append((result is t, t[0].item(), work.completed_at is not None))
    # the reduce-scatter gloo runs as an all-reduce: its copy-out chained before the result
    shard = torch.empty(500)
    work = comm.reduce_scatter(shard, torch.arange(1000.0), async_op=True)
    out.append(torch.equal(work.wait(), torch.arange(1000.0)[rank * 500:(rank + 1) * 500] * world_size))
    return out


def test_backend_collectives_return_their_tensor_and_a_completion_time_timed_or_not() -> None:
    for result in run_on_ranks(_timed_and_untimed, 2):
        assert result[:2] == [(True, 1.0, True), (True, 1.0, True)]
        assert result[2] is True


def _hooks_seen(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.00005)  # 52 bytes: a bucket or two per layer
    reducer = ddp.reducer
    calls = []
    default = reducer.comm_hook
    assert isinstance(default, SumAllReduce) and reducer.comm_hook is reducer.default_hook

    def spy(state, bucket):  # every bucket leaves through the hook, the default one included
        calls.append(bucket.index())
        return default(state, bucket)

    reducer.comm_hook = spy
    ddp(torch.randn(4, 8)).sum().backward()
    reducer.record_spans = True
    ddp(torch.randn(4, 8)).sum().backward()
    spans = ddp.last_step_comm.bucket_spans
    return [calls, len(reducer.buckets), default.timed, all(s[2] is not None and s[2] >= s[1] for s in spans)]


def test_the_engine_reduces_every_bucket_through_its_comm_hook_default_included() -> None:
    for calls, buckets, timed, spans_done in run_on_ranks(_hooks_seen, 2):
        assert buckets > 1
        assert calls == list(range(buckets)) * 2
        assert timed is True and spans_done

