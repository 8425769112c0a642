"""Live recovery for strategies whose replicas meet every few steps (local SGD, DiLoCo): a round only at a meeting,
a healed member adding nothing to it, an aborted meeting leaving nothing changed (dptrain.runner.live_meetings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _cli import dptrain, tiny_gpt_config
from dptrain.diloco.outer import OuterStep, outer_optimizer
from dptrain.localsgd import LocalSGD
from dptrain.testing import run_on_ranks


def _round_group(rank: int, world_size: int, path: str) -> dist.ProcessGroup:
    """A gloo group made outside torch.distributed's world, as live recovery makes a round's."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.FileStore(path, world_size), rank, world_size, opts)


def _meetings(rank: int, world_size: int, path: str) -> dict:
    """Ranks 0 and 1 took their own steps; rank 2 was healed from rank 0 (it holds rank 0's weights) and sits the
    meeting out. What each meeting gives, beside what it should."""
    group = _round_group(rank, world_size, path)
    torch.manual_seed(0)
    start = [torch.randn(40, 3), torch.randn(50)]
    local = [[t + 0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(r + 7)) for t in start]
             for r in range(2)]
    mine = [t.clone() for t in local[min(rank, 1) if rank < 2 else 0]]
    participating = rank < 2
    out = {}
    # DiLoCo, uncompressed: the outer step from the two participants' mean pseudo-gradient
    outer = OuterStep(start, lr=0.7, momentum=0.9, nesterov=True)
    params = [t.clone() for t in mine]
    outer.apply(outer.reduce_over(params, group, 2, participating).delta, params)
    expected = [t.clone() for t in start]
    optimizer = outer_optimizer(expected, 0.7, 0.9, True)
    for g, a, b in zip(expected, *local, strict=True):
        g.grad = g - (a + b) / 2
    optimizer.step()
    out["diloco"] = all(torch.allclose(p, e, atol=1e-6) for p, e in zip(params, expected, strict=True))
    out["diloco_bits"] = torch.cat([p.reshape(-1) for p in params])
    # DiLoCo, int8: the same within the codec's error, the same bits on every member
    compressed = OuterStep(start, lr=0.7, momentum=0.9, nesterov=True, compression="int8")
    params = [t.clone() for t in mine]
    reduced = compressed.reduce_over(params, group, 2, participating)
    compressed.apply(reduced.delta, params)
    out["int8"] = max((p - e).abs().max().item() for p, e in zip(params, expected, strict=True))
    out["int8_bits"] = torch.cat([p.reshape(-1) for p in params])
    before = compressed.residual()["feedback"]["residuals"]
    out["int8_residual"] = sum(v.abs().sum().item() for v in before.values())
    # ... and a meeting that aborts leaves the residual as it was (its encoding changed it)
    for p in params:
        p.add_(0.01)
    reduced = compressed.reduce_over(params, group, 2, participating)
    changed = compressed.residual()["feedback"]["residuals"]
    compressed.restore(reduced)
    restored = compressed.residual()["feedback"]["residuals"]
    out["changed"] = any(not torch.equal(changed[k], v) for k, v in before.items())
    out["restored"] = restored.keys() == before.keys() and all(torch.equal(restored[k], v) for k, v in before.items())
    # local SGD: the participants' mean
    model = torch.nn.Linear(3, 2)
    wrapper = LocalSGD(model, period=2)
    with torch.no_grad():
        for p, r in zip(wrapper.module.parameters(), (rank if rank < 2 else 0, 0), strict=False):
            p.fill_(float(r + 1))
    mean = wrapper.launch_meeting(group, 2, participating, 2, False)()
    wrapper.apply_meeting(mean)
    out["localsgd"] = wrapper.module.weight.detach().clone()
    return out


def test_a_meeting_averages_its_participants_and_a_healed_member_adds_nothing(tmp_path):
    results = run_on_ranks(_meetings, 3, str(tmp_path / "store"))
    assert [r["changed"] for r in results] == [True, True, False]  # the healed member keeps no residual
    for r in results:
        assert r["diloco"] and r["restored"]
        assert r["int8"] < 0.05  # int8's rounding, not another mean (that would be off by ~0.1)
        torch.testing.assert_close(r["localsgd"], torch.full((2, 3), 1.5))
    for key in ("diloco_bits", "int8_bits"):
        assert all(torch.equal(r[key], results[0][key]) for r in results)  # every member holds the same
    assert results[2]["int8_residual"] == 0.0  # the healed member's residual was cleared, and it sent zeros
    assert results[0]["int8_residual"] > 0.0


def _live_logs(run_dir: Path) -> dict[int, list[dict]]:
    logs = {}
    for path in sorted((run_dir / "logs").glob("live*.jsonl")):
        logs[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return logs


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


LIVE = "\n[live]\nenabled = true\nheartbeat_timeout_s = 1.0\ncheck_every = 1\n"


@pytest.mark.parametrize("strategy, settings, fault, meetings, rounds", [
    # between meetings: healed at the next, which it sits out (int8 pseudo-gradients, error feedback)
    ("diloco", ["diloco.period=4", 'diloco.compression="int8"'], "1:6:kill", [0, 4, 8, 12, 16], 5),
    # ... and killed again as that heal arrives (its sender has stepped on): healed at the meeting after
    ("diloco", ["diloco.period=4"], "1:6:kill-in-heal", [0, 4, 8, 12, 16], 5),
    # after the meeting's all-reduce, before its vote: the meeting again, the survivors' steps kept
    ("localsgd", ["localsgd.period=3"], "2:4:kill-before-vote", [0, 1, 4, 7, 10, 13, 16], 7),
    # a warm-up of 3 synchronous steps (a round each), killed before a step's vote; then a meeting to slice the
    # steps between meetings (at step 3 too), and the meetings
    ("diloco", ["diloco.period=4", "diloco.warmup_steps=3"], "1:2:kill-before-vote", [1, 2, 3, 7, 11, 15, 16], 8),
    # Streaming DiLoCo: a fragment's meeting every 2 steps (mixing, 4-bit), killed between two; all at the last
    ("diloco", ["diloco.period=4", "diloco.fragments=2", "diloco.mixing=0.5", 'diloco.compression="e3m0"'],
     "1:5:kill", [0, 2, 4, 6, 8, 10, 12, 14, 16], 9),
    # ... with a step of overlap: a meeting's round opens a step before it lands (after steps 2, 5, 8...), its
    # reduction running beside that step: killed as step 8 begins, restarted, it joins the round opened after it
    ("diloco", ["diloco.period=6", "diloco.fragments=2", "diloco.overlap_steps=1"], "1:8:kill",
     [0, 3, 6, 9, 12, 15, 16], 7),
    # ... killed after that round's reduction, before its vote: it aborts, and is held again at its landing
    ("diloco", ["diloco.period=6", "diloco.fragments=2", "diloco.overlap_steps=1"], "1:9:kill-before-vote",
     [0, 3, 6, 9, 12, 15, 16], 7),
])
def test_survivors_keep_their_steps_and_meet_with_the_victim_healed(tmp_path, strategy, settings, fault, meetings,
                                                                    rounds):
    """A worker killed between two meetings (and again during its heal), between a meeting's all-reduce and its vote,
    or before the vote of a warm-up's step: the launcher restarts it; the others' steps are kept; every committed round leaves every member
    with the same state (hash); the victim is healed and the run ends with every round committed."""
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", "3", "--config", str(tiny_gpt_config(tmp_path, LIVE)), "--run-dir", str(run_dir),
                   "--strategy", strategy, *[a for x in settings for a in ("--set", x)], "--set", "train.steps=16",
                   "--set", "train.global_batch_size=6", "--set", "log.trace_steps=0", "--set", "log.eval_every=0",
                   cwd=tmp_path, env={"DPTRAIN_FAULT": fault})
    assert proc.returncode == 0, proc.stderr[-3000:]
    victim = int(fault.split(":")[0])
    assert f"worker {victim} exited" in proc.stderr
    if "in-heal" in fault:
        assert "restarting it (2 of" in proc.stderr
    logs = _live_logs(run_dir)
    hashes: dict[int, set] = {}
    decisions: dict[int, set] = {}
    for records in logs.values():
        for r in records:
            if "round" in r:
                decisions.setdefault(r["round"], set()).add(r["commit"])
            if "hash" in r:
                hashes.setdefault(r["step"], set()).add(r["hash"])
    assert sorted(hashes) == meetings  # a round only where the replicas meet
    assert all(len(h) == 1 for h in hashes.values()), {s: len(h) for s, h in hashes.items()}
    assert all(len(d) == 1 for d in decisions.values())
    healed = [r for r in logs[victim] if r.get("heal_received")]
    assert healed
    if "warmup" not in " ".join(settings):  # healed at a meeting: after its vote, then it sits the next steps out
        assert healed[0]["commit"] and healed[0].get("healed_after_vote")
        batches = [r["live_global_batch"] for r in _records(run_dir) if "live_global_batch" in r]
        values = dict(x.split("=") for x in settings)
        slot = int(values["diloco.period" if strategy == "diloco" else "localsgd.period"]) // \
            int(values.get("diloco.fragments", 1))  # the steps between two meetings
        assert set(batches) == {4, 6} and batches.count(4) % slot == 0  # rounds of 2 of 3
    if "before-vote" in fault:  # the meeting aborted, then held again (the survivors' steps kept)
        step = int(fault.split(":")[1])
        assert [r["commit"] for r in logs[0] if r.get("step") == step and "round" in r] == [False, True]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["live"]["committed"] == rounds
    assert summary["live"]["unit"] == ("rounds" if "warmup" in " ".join(settings) else "meetings")
    assert (run_dir / "model.safetensors").is_file()


def test_a_run_resumed_where_an_overlapped_meeting_starts_trains_every_step_and_meets_at_the_landing(tmp_path):
    """Streaming DiLoCo (H = 6, 2 fragments, a step of overlap: reductions start after steps 2, 5, 8, 11) stopped at
    step 7 with its checkpoint at step 5, a start step, then resumed to 12: no member has steps to meet there, so
    the meeting is held at its landing, 6, unoverlapped; every step from 6 on is trained, every sync point met."""
    config = str(tiny_gpt_config(tmp_path, LIVE))
    common = ["--config", config, "--strategy", "diloco", "--set", "diloco.period=6", "--set", "diloco.fragments=2",
              "--set", "diloco.overlap_steps=1", "--set", "train.global_batch_size=6", "--set", "log.trace_steps=0",
              "--set", "log.eval_every=0", "--set", "checkpoint.every=5", "--set", "train.steps=12",
              "--run-dir", str(tmp_path / "run")]
    stopped = dptrain("run", "--nproc", "2", *common, "--set", "live.min_workers=2", "--set", "live.max_restarts=0",
                      cwd=tmp_path, env={"DPTRAIN_FAULT": "1:7:raise"})
    assert stopped.returncode != 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000005"]
    again = dptrain("run", "--nproc", "2", *common, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [r for r in _records(tmp_path / "run") if r.get("kind") == "train" and r["step"] > 5]
    steps = [r["step"] for r in resumed]
    assert steps[-7:] == list(range(6, 13))  # (a torn record of the first run's step 6 or 7 may come before)
    synced = [r["step"] for r in resumed[-7:] if r["steps_since_sync"] == 0]
    assert synced == [6, 9, 12]


def test_an_overlapped_meetings_vote_waits_for_a_member_slow_in_the_steps_beside_it(tmp_path):
    """Streaming DiLoCo with a step of overlap: the meeting that lands after step 3 opens after step 2; worker 0
    takes 3 s over step 3 (live.heartbeat_timeout_s = 1, it beats all along). Worker 1 votes at once; its vote waits
    for worker 0's as long as live.join_timeout_s, as a round waits for a member that beats but has not arrived:
    every meeting commits."""
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp_path, LIVE)), "--run-dir", str(run_dir),
                   "--strategy", "diloco", "--set", "diloco.period=6", "--set", "diloco.fragments=2",
                   "--set", "diloco.overlap_steps=1", "--set", "train.global_batch_size=6", "--set", "train.steps=7",
                   "--set", "log.trace_steps=0", "--set", "log.eval_every=0", cwd=tmp_path,
                   env={"DPTRAIN_FAULT": "0:3:delay", "DPTRAIN_FAULT_DELAY_S": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = [(r["step"], r["commit"]) for r in _live_logs(run_dir)[0] if "round" in r]
    assert rounds == [(0, True), (3, True), (6, True), (7, True)]
