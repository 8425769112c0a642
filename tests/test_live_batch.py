"""Live recovery's ``live.global_batch = "constant"``: a round of fewer workers takes the whole global batch, each
member more micro-steps, so that a step with k of N workers is the same optimizer step as with N."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from _cli import dptrain, tiny_gpt_config
from dptrain.config import ConfigError, load_config
from dptrain.data.stream import SampleStream
from dptrain.runner.live_state import ReplicaState
from test_live import LIVE, _check_survivors


def _replica(replicas: int, micro: int, accum: int, constant: bool) -> ReplicaState:
    engine = SimpleNamespace(plan=SimpleNamespace(micro_batch_size=micro, grad_accum_steps=accum), lr_at=None)
    stream = SampleStream(list(range(1000)), seed=3, collate_fn=lambda samples: torch.tensor(samples))
    return ReplicaState(engine, stream, position=37, replicas=replicas, linear=False, constant=constant)


@pytest.mark.parametrize("replicas, micro, accum", [(4, 3, 2), (3, 1, 1), (5, 2, 3)])
def test_a_round_of_any_size_takes_the_global_batch_each_sample_once_at_one_over_b(replicas, micro, accum):
    total = replicas * micro * accum
    full = _replica(replicas, micro, accum, constant=False)
    everyone = [full.stream.indices(37, total)[j][1] for j in range(total)]
    for k in range(1, replicas + 1):
        members = [_replica(replicas, micro, accum, constant=True).enter(SimpleNamespace(size=k, index=i))[0]
                   for i in range(k)]
        counts = {len(m) for m in members}
        assert len(counts) == 1, f"members of a round of {k} take different numbers of micro-steps: {counts}"
        count = counts.pop()
        taken = [int(x) for m in members for batch, _ in m for x in batch]
        assert taken == everyone, f"a round of {k} does not take the global batch once, in order"
        for m in members:
            for batch, weight in m:
                assert len(batch) <= max(micro, -(-total // (k * count)))
                # the engine scales the loss by weight x accum, the step divides by count, the hook by k
                assert weight * accum / (count * k) == pytest.approx(len(batch) / total)
    # a round of every replica is the shrinking mode's step: the same micro-batches, weight 1 / accum
    shrinking = full.enter(SimpleNamespace(size=replicas, index=1))
    constant = _replica(replicas, micro, accum, constant=True).enter(SimpleNamespace(size=replicas, index=1))[0]
    assert [b.tolist() for b in shrinking] == [b.tolist() for b, _ in constant]
    assert all(w == 1 / accum for _, w in constant)


def test_the_weighted_members_gradient_is_the_full_steps():
    """The arithmetic of the engine (loss x weight x accum, the window divided by its count) and of the round's hook
    (summed, divided by k) on 3 of 4 replicas gives the gradient of the mean loss over the whole global batch."""
    torch.manual_seed(0)
    data = torch.randn(1000, 5)
    w = torch.randn(5, requires_grad=True)

    def loss(batch):
        return (data[batch] @ w).pow(2).mean()

    replicas, micro, accum, k = 4, 3, 2, 3
    total = replicas * micro * accum
    summed = torch.zeros(5)
    for i in range(k):
        w.grad = None
        steps = _replica(replicas, micro, accum, constant=True).enter(SimpleNamespace(size=k, index=i))[0]
        for batch, weight in steps:
            (loss(batch) * (weight * accum)).backward()
        summed += w.grad / len(steps)  # each member's step divides by its window; the hook sums
    w.grad = None
    order = _replica(replicas, micro, accum, constant=False).stream.indices(37, total)
    loss(torch.tensor([index for _, index in order])).backward()
    assert torch.allclose(summed / k, w.grad, rtol=1e-5, atol=1e-6)


def test_constant_refuses_a_learning_rate_scaled_by_the_round():
    with pytest.raises(ConfigError, match="live.global_batch = \"constant\" keeps the global batch"):
        load_config(None, ["live.enabled=true", "live.global_batch=constant", "live.lr_scaling=linear"]).check()


def test_a_killed_worker_leaves_every_committed_step_the_global_batch(tmp_path):
    """3 workers, worker 1 killed at step 5: the two left take the whole global batch of 6 (each 3 micro-steps of 1
    where the three took 2 of 1), every committed step's batch is 6, and the survivors hold the same state."""
    run_dir = tmp_path / "run"
    config = tiny_gpt_config(tmp_path, LIVE + 'global_batch = "constant"\n')
    proc = dptrain("run", "--nproc", "3", "--config", str(config), "--run-dir", str(run_dir),
                   "--set", "train.steps=12", "--set", "train.global_batch_size=6", "--set", "log.trace_steps=0",
                   "--set", "log.eval_every=0", "--set", "log.every=1", cwd=tmp_path, env={"DPTRAIN_FAULT": "1:5:kill"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_survivors(run_dir, 12, victim=1, fault_step=5, healed=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    batches = {r["step"]: r["live_global_batch"] for r in records if "live_global_batch" in r}
    assert batches and set(batches.values()) == {6}, batches
    assert "global batch kept" in (run_dir / "logs" / "rank0.log").read_text()
