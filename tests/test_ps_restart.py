"""Parameter-server checkpoints: a killed server restarts under ``--max-restarts``, a killed worker's job resumes
when started again, and the run finishes (sync: with the uninterrupted run's parameters, bit for bit), every shard of a cut holds the same gradients, a
server's state survives a round trip, and a resume on another layout is refused.

The runs: a 2-block GPT with dropout (so the workers' random streams must be restored), 2 workers and a server,
10 steps, a checkpoint every 4. A cut is published about one step after it is taken, so a kill at step 7
resumes from step 4."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from _cli import dptrain, tiny_gpt_config
from dptrain.optim.build import build_optimizer
from dptrain.ps import Consistency, CutSchedule, ShardServer
from dptrain.ps.snapshot import Cuts
from dptrain.ps.wire import Kind, Message

pytestmark = pytest.mark.timeout(240)

SETTINGS = ["--set", "distributed.strategy=ps", "--set", "train.steps=10", "--set", "checkpoint.every=4"]
SYNC = ["--nproc", "3", *SETTINGS]


def _run(cwd, run_dir, *args: str, env: dict | None = None):
    return dptrain("run", "--config", str(tiny_gpt_config(cwd)), "--run-dir", str(run_dir), *args, cwd=cwd, env=env,
                   timeout=240)


def _losses(run_dir) -> list[tuple[int, float]]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted sync run, its directory shared by the tests that compare with it or try to resume it."""
    cwd = tmp_path_factory.mktemp("ps_straight")
    done = _run(cwd, cwd / "run", *SYNC)
    assert done.returncode == 0, done.stderr
    return cwd / "run"


def _assert_same_run(a, b) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _losses(a) == _losses(b)  # the steps logged before the kill were replayed, and replaced


@pytest.mark.slow
def test_a_killed_server_of_a_sync_run_restarts_and_ends_with_the_uninterrupted_parameters(straight, tmp_path):
    """Under --max-restarts: torchrun's agent starts all three ranks again, and they resume from the cut."""
    done = _run(tmp_path, tmp_path / "run", *SYNC, "--max-restarts", "1", "--fault", "2:7:kill")
    assert done.returncode == 0, done.stderr
    assert "step_00000004 at step 4" in done.stdout
    summary = _summary(tmp_path / "run")
    assert summary["restarts"] == 1 and summary["start_step"] == 4 and summary["ps"]["checkpoints"] == [8, 10]
    _assert_same_run(straight, tmp_path / "run")


def test_a_killed_worker_of_a_sync_run_resumes_by_hand_and_ends_with_the_uninterrupted_parameters(straight, tmp_path):
    """The job ends at the kill (exit 1); started again in its directory, it resumes from the cut. (The restart under
    --max-restarts is the same resume, started by torchrun's agent: the server's case above runs it.)"""
    killed = _run(tmp_path, tmp_path / "run", *SYNC, "--fault", "1:7:kill")
    assert killed.returncode == 1 and "rank 1" in killed.stderr and "SIGKILL" in killed.stderr, killed.stderr
    done = _run(tmp_path, tmp_path / "run", *SYNC)
    assert done.returncode == 0, done.stderr
    assert "step_00000004 at step 4" in done.stdout
    summary = _summary(tmp_path / "run")
    assert summary["start_step"] == 4 and summary["ps"]["checkpoints"] == [8, 10]
    _assert_same_run(straight, tmp_path / "run")


@pytest.mark.slow
def test_an_async_run_with_a_killed_server_restarts_and_finishes(tmp_path):
    """The first of 2 servers (it begins every cut) is killed; the run resumes from a cut and trains on.

    In SSP, an async mode whose bound keeps either worker from starving: a cut completes once every worker has
    heard of it, and in plain async mode on 2 loaded cores one worker once pushed 13 gradients to the other's 3
    before the kill, so no cut had completed and the run restarted from scratch (3 runs in 10)."""
    run_dir = tmp_path / "run"
    done = _run(tmp_path, run_dir, "--nproc", "4", "--set", "distributed.strategy=ps", "--set", "ps.servers=2",
                "--set", "ps.mode=ssp", "--set", "ps.staleness=1", "--set", "train.steps=10",
                "--set", "checkpoint.every=4", "--max-restarts", "1", "--fault", "2:9:kill")
    assert done.returncode == 0, done.stderr
    summary = _summary(run_dir)
    assert summary["restarts"] == 1 and summary["start_step"] in (4, 8), summary["start_step"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000008", "step_00000010"]
    losses = _losses(run_dir)
    assert losses[-1][0] == 10 and all(torch.isfinite(torch.tensor(loss)) for _, loss in losses)
    assert summary["val_loss"] < losses[0][1]  # it trained
    for report in summary["ps"]["servers_report"].values():
        assert report["updates"] == 20  # 10 steps x 2 workers, the first session's included


def test_every_shard_of_an_async_cut_holds_the_same_gradients(tmp_path):
    """The snapshot protocol's invariant, read from the files: for each cut and each server, the gradients applied
    before its snapshot plus those it recorded in flight are exactly worker w's gradients 1..c_w, with the same c_w
    on every server. A straggler makes the servers' snapshots fall at different moments, with gradients in flight.
    (The last cut is the run's end: each async server stops at its budget, so it is left out.)"""
    run_dir = tmp_path / "run"
    done = dptrain("run", "--nproc", "5", "--run-dir", str(run_dir), "--set", "distributed.strategy=ps", "--set",
                   "ps.servers=2", "--set", "ps.mode=async", "--set", "task.name=classifier", "--set",
                   "train.steps=16", "--set", "train.global_batch_size=15", "--set", "checkpoint.every=3", "--set",
                   "checkpoint.keep_last=10", "--set", "straggler.rank=1", "--set", "straggler.factor=20", "--set",
                   "log.progress=lines", "--set", "log.plots=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    cuts = sorted((run_dir / "checkpoints").iterdir())
    assert [c.name for c in cuts] == [f"step_{k:08d}" for k in (3, 6, 9, 12, 15, 16)]
    in_flight = 0
    for cut in cuts[:-1]:
        clocks = []
        for server in (0, 1):
            state = torch.load(cut / "ps" / f"server{server}.pt", weights_only=True)
            transit = torch.load(cut / "ps" / f"transit{server}.pt", weights_only=True)
            applied = [(w, clock) for w, clock, *_ in state["records"].tolist()]
            recorded = [(r["worker"], r["clock"]) for r in transit["transit"]]
            expected = {(w, k) for w, c in transit["clocks"].items() for k in range(1, c + 1)}
            assert sorted(applied + recorded) == sorted(expected), (cut.name, server)
            clocks.append(transit["clocks"])
            in_flight += len(recorded)
        assert clocks[0] == clocks[1], cut.name
    assert in_flight > 0  # the recording was exercised (17-25 gradients in runs of this test)


def _server(lookahead: bool) -> ShardServer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    return ShardServer(list(model.parameters()), lambda m: build_optimizer(m, "adamw", 0.05, 0.1, (0.9, 0.99), 0.9),
                       {0: None, 1: None}, Consistency("async"), steps=10, lr_at=lambda s: 0.01 / (1 + s),
                       lookahead=lookahead)


def _through_a_file(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def test_a_server_restored_from_its_state_continues_exactly():
    """Six async gradients applied by one server, against three, a state saved through a file, and three more
    applied by a fresh server restored from it: the same shard, optimizer moments, version (the learning-rate
    schedule's position), delays and look-ahead expectations."""
    g = torch.Generator().manual_seed(1)
    n = _server(False).flat.numel()
    grads = [(i % 2, Message(Kind.GRAD, i // 2 + 1, 0, torch.randn(n, generator=g), 0.5)) for i in range(6)]
    fresh = _through_a_file(_server(True).state_dict())
    clocks = {0: 3, 1: 3}
    straight = _server(True)
    straight.restore(fresh, grads, clocks)
    first = _server(True)
    first.restore(fresh, grads[:3], clocks)
    middle = _through_a_file(first.state_dict())
    resumed = _server(True)
    resumed.restore(middle, grads[3:], clocks)
    assert torch.equal(straight.flat, resumed.flat) and straight.version == resumed.version == 6
    for a, b in zip(straight.optimizer.state.values(), resumed.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert straight.records == resumed.records and straight.lookahead.expected == resumed.lookahead.expected
    forgetful = _server(True)  # the oracle's premise: without the optimizer state the continuation differs
    forgetful.restore({**middle, "optimizer": fresh["optimizer"]}, grads[3:], clocks)
    assert not torch.equal(straight.flat, forgetful.flat)


class _Files:
    def __init__(self):
        self.snapshots, self.closed = [], []

    def snapshot(self, label, state):
        self.snapshots.append((label, state["v"]))

    def close(self, cut):
        self.closed.append((cut.label, dict(cut.marks), [(w, m.a) for w, m in cut.transit]))


def test_cuts_record_in_flight_gradients_until_each_mark_and_close_oldest_first():
    files = _Files()
    cuts = Cuts(CutSchedule(every=2, steps=5), files, in_flight=True)
    assert CutSchedule(2, 5).due(0, 9) == [2, 4, 5] and CutSchedule(0, 5).due(0, 4) == []
    cuts.begin(4, lambda: {"v": 7})  # two cuts due at once: one state, written for each
    assert files.snapshots == [(2, 7), (4, 7)] and cuts.begun == 4
    grad = Message(Kind.GRAD, 3, 0, torch.ones(2), 0.1)
    cuts.record(0, grad)
    cuts.mark(0, 2, 3, None, live={0, 1})  # worker 0 marks cut 2 only
    cuts.record(0, Message(Kind.GRAD, 4, 0, torch.ones(2), 0.1))  # after its mark of 2, before its mark of 4
    cuts.record(1, Message(Kind.GRAD, 5, 0, torch.ones(2), 0.1))
    assert files.closed == []
    cuts.mark(1, 4, 5, None, live={0, 1})  # worker 1 marks both: cut 2 is complete
    assert files.closed == [(2, {0: (3, None), 1: (5, None)}, [(0, 3), (1, 5)])] and cuts.saved == 2
    cuts.mark(0, float("inf"), 4, None, live={1})  # worker 0 dies: it counts as marked at its last gradient
    assert files.closed[1] == (4, {1: (5, None), 0: (4, None)}, [(0, 3), (0, 4), (1, 5)]) and cuts.saved == 4


@pytest.mark.parametrize("args, message", [
    (["--nproc", "5"], "was saved by a parameter-server job of 3 ranks with ps.servers=1 and ps.mode='sync'; this "
                       "run has 5 ranks with ps.servers=1 and ps.mode='sync'"),
    (["--nproc", "4", "--set", "ps.servers=2"], "this run has 4 ranks with ps.servers=2"),
    (["--nproc", "3", "--set", "ps.mode=async"], "this run has 3 ranks with ps.servers=1 and ps.mode='async'"),
    (["--nproc", "2", "--set", "distributed.strategy=ddp"], "is ps (written with distributed.strategy ps) and this run's strategy "
                                                     "writes replicated checkpoints"),
])
def test_a_resume_on_another_layout_is_refused_before_start(straight, args, message):
    """Refused by validate_run, which every rank runs before the process group exists: an error, never a hang."""
    before = sorted(p.name for p in straight.rglob("*"))
    done = _run(straight.parent, straight, *SETTINGS, *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    if "distributed.strategy=ddp" not in args:  # the fix, with the values to use
        assert "run with --nproc 3 --set ps.servers=1 --set ps.mode=sync, or start afresh" in done.stderr
    assert sorted(p.name for p in straight.rglob("*")) == before  # nothing written
