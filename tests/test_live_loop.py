"""Live recovery in a user's own loop (``dptrain.Live`` over prepare()'s model, ``dptrain launch --live-restarts``):
a worker killed between its all-reduce and its vote is restarted alone and healed, the others go on, every step is
committed once, and the replicas hold the same state after every committed round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dptrain
from _cli import dptrain as run_dptrain

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "live_loop.py"
ENGINE_LOOP = Path(__file__).resolve().parent / "_live_engine.py"


def _logs(run_dir: Path) -> dict[int, list[dict]]:
    logs = {}
    for path in sorted((run_dir / "logs").glob("live*.jsonl")):
        logs[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return logs


@pytest.mark.timeout(240)
def test_a_user_loop_survives_a_worker_killed_before_its_vote(tmp_path):
    run_dir, steps = tmp_path / "run", 12
    proc = run_dptrain("launch", "--nproc", "3", "--live-restarts", "2", "--start-method", "forkserver", "--run-dir", str(run_dir), str(EXAMPLE),
                       "--steps", str(steps), "--kill", "1:5", "--check-every", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = _logs(run_dir)
    assert sorted(logs) == [0, 1, 2]
    # replica 1 died before its vote at step 5: that round aborted on the others, who went on without it
    aborted = [r for r in logs[0] if r.get("commit") is False]
    assert aborted and aborted[0]["step"] == 5 and 1 in aborted[0]["members"]
    # restarted (its second start, holding nothing) and healed from a peer
    starts = [r for r in logs[1] if r.get("event") == "start"]
    assert [(s["restart"], s["step"]) for s in starts] == [(0, 0), (1, -1)]
    assert any(r.get("heal_received", 0) > 0 for r in logs[1])
    # every step committed once; every member of a committed round holds the same state after it
    committed = sorted({r["step"] for r in logs[0] if r.get("commit")})
    assert committed == list(range(1, steps + 1))
    hashes = _committed_hashes(logs)
    assert set(hashes) == set(committed) and all(len(h) == 1 for h in hashes.values())
    rejoined = [r for r in logs[1] if r.get("commit") and r["step"] > 5]
    assert rejoined and all(r["members"] == [0, 1, 2] for r in rejoined[-2:])  # back in the last rounds
    assert f"{steps} of {steps + len(aborted)} attempted steps committed" in proc.stdout
    assert f"replica 0: {steps} steps" in proc.stdout


def _committed_hashes(logs: dict[int, list[dict]]) -> dict[int, set[str]]:
    """Step -> the state hashes its committed round's members logged."""
    hashes: dict[int, set[str]] = {}
    for records in logs.values():
        for r in records:
            if r.get("commit") and "hash" in r:
                hashes.setdefault(r["step"], set()).add(r["hash"])
    return hashes


@pytest.mark.timeout(240)
def test_an_engine_loop_heals_a_restarted_worker_with_its_step_count(tmp_path):
    """The Engine path: a worker killed at the start of step 3 comes back healed with the engine's step count, so its
    learning rate is the schedule's at the end, as on the others."""
    run_dir = tmp_path / "run"
    proc = run_dptrain("launch", "--nproc", "2", "--live-restarts", "1", "--start-method", "forkserver",
                       "--run-dir", str(run_dir), "--ranks", "all", str(ENGINE_LOOP), "--kill", "1:3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hashes = _committed_hashes(_logs(run_dir))
    assert sorted(hashes) == list(range(1, 9)) and all(len(h) == 1 for h in hashes.values())
    restarted = (run_dir / "logs" / "rank1.restart1.console").read_text()
    line = [x for x in proc.stdout.splitlines() if "replica 0:" in x][0].split("replica 0: ")[1]
    assert line.startswith("step 8, engine 8, lr ") and f"replica 1: {line}" in restarted


def test_live_refuses_a_strategy_whose_ranks_hold_shards_and_needs_the_store(monkeypatch):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for strategy in ("zero2", "localsgd"):
            model, optimizer = _prepared(strategy)
            with pytest.raises(ValueError, match=rf"strategy '{strategy}' cannot in your own loop.*strategy ddp"):
                dptrain.Live(model, optimizer, steps=4)
        monkeypatch.delenv("DPTRAIN_LIVE_STORE", raising=False)
        model, optimizer = _prepared("ddp")
        with pytest.raises(ValueError, match="DPTRAIN_LIVE_STORE names: run the script under dptrain launch "
                                             "--live-restarts N"):
            dptrain.Live(model, optimizer, steps=4)
        with pytest.raises(TypeError, match="prepare\\(\\)'s model and optimizer, or an Engine"):
            dptrain.Live(nn.Linear(2, 2), None, steps=4)
    finally:
        dist.destroy_process_group()


def _prepared(strategy: str, grad_clip: float = 0.0):
    model = nn.Linear(4, 2)
    return dptrain.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0), strategy=strategy, grad_clip=grad_clip)


def test_a_committed_round_steps_through_prepare_s_optimizer_which_clips(monkeypatch, tmp_path):
    """One worker, rounds of one: the commit is prepare()'s step (here its clip bounds the update), the log is
    written, and every step is committed once."""
    from dptrain.live.store import serve_store

    store = serve_store("127.0.0.1", 0)
    monkeypatch.setenv("DPTRAIN_LIVE_STORE", f"127.0.0.1:{store.port}")
    for name in ("RANK", "WORLD_SIZE", "DPTRAIN_REPLICA_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, optimizer = _prepared("ddp", grad_clip=1e-3)
        data = torch.utils.data.TensorDataset(torch.randn(16, 4) * 100, torch.randn(16, 2))
        live = dptrain.Live(model, optimizer, steps=3, dataset=data, batch_size=4, run_dir=tmp_path,
                            heartbeat_timeout_s=1.0)
        for r in live:
            before = [p.detach().clone() for p in model.parameters()]
            for x, y in r.batches():
                torch.nn.functional.mse_loss(model(x), y).backward()
            assert r.commit()
            moved = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before, strict=True)])
            assert 0 < moved.norm().item() <= 1e-3 * 1.0001  # lr 1 x the clipped norm
        assert live.step == 3 and live.totals()["committed"] == 3
    finally:
        dist.destroy_process_group()
