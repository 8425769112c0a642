"""The replica divergence monitor and the injected faults: checksums that see one flipped bit, detection on
every rank naming the first tensor and the ranks off the majority, repair from a healthy rank; from the CLI, a
flipped bit, a NaN gradient, a hung rank and a rank that calls another collective."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from _cli import dptrain
from dptrain.checkpoint.replicated import replica_tensors
from dptrain.runner.divergence import DivergenceError, DivergenceMonitor, checksum
from dptrain.testing import run_on_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64])
def test_checksum_sees_one_flipped_bit_and_two_swapped_words(dtype):
    t = (torch.arange(1, 12) * 3).to(dtype)
    same = t.clone()
    assert torch.equal(checksum(t), checksum(same))
    flipped = t.clone()
    flipped.view(-1)[:1].view(torch.uint8)[0] ^= 1
    assert not torch.equal(checksum(t), checksum(flipped))
    swapped = t.clone()
    swapped[[2, 7]] = swapped[[7, 2]]
    assert not torch.equal(checksum(t), checksum(swapped))
    assert checksum(torch.tensor(5.0)).shape == (2,)  # a 0-dim tensor (an optimizer's step) too


def _replicas(rank, world_size, corrupt_rank, what, repair):
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        if rank == corrupt_rank and what == "buffer":
            model[1].running_mean[1] += 1e-7
        if rank == corrupt_rank and what == "optimizer":
            opt.state[model[0].weight]["exp_avg_sq"][0, 0] *= 2
    monitor = DivergenceMonitor(lambda: replica_tensors(model, opt), repair=repair)
    try:
        found = monitor.check(step=7)
    except DivergenceError as e:
        return str(e)
    return found, [t.clone() for _, t in replica_tensors(model, opt)]


@pytest.mark.parametrize("what, name", [("buffer", "buffer 1.running_mean"),
                                        ("optimizer", "optimizer state 0.weight.exp_avg_sq")])
def test_a_corrupted_replica_is_named_on_every_rank(what, name):
    messages = run_on_ranks(_replicas, 3, 2, what, False)
    for message in messages:  # every rank raised, with the same diagnosis
        assert f"replicas diverged at step 7: {name} differs first (1 of " in message
        assert "rank(s) [2] disagree with the majority" in message


def test_repair_copies_a_healthy_rank_and_equal_replicas_pass():
    results = run_on_ranks(_replicas, 3, 0, "buffer", True)  # rank 0 is the odd one: rank 1 is the source
    for found, tensors in results:
        assert found.bad_ranks == [0] and found.source == 1 and found.tensor == "buffer 1.running_mean"
        for a, b in zip(tensors, results[1][1], strict=True):
            assert torch.equal(a, b)
    clean = run_on_ranks(_replicas, 2, -1, "buffer", False)
    assert all(found is None for found, _ in clean)


SMALL = ["--nproc", "2", "--set", "task.name=classifier", "--set", "train.steps=10", "--set", "log.every=1",
         "--set", "log.progress=lines", "--set", "log.plots=false", "--set", "distributed.roll_call_s=1",
         "--set", "divergence.every=2"]


def test_a_flipped_bit_is_caught_within_k_steps_or_repaired(tmp_path):
    stopped = dptrain("run", "--run-dir", str(tmp_path / "a"), *SMALL, env={"DPTRAIN_FAULT": "1:5:flip"},
                      cwd=tmp_path)
    assert stopped.returncode == 1
    assert ("DivergenceError: replicas diverged at step 6: parameter net.0.weight differs first (1 of"
            in stopped.stderr), stopped.stderr
    repaired = dptrain("run", "--run-dir", str(tmp_path / "b"), *SMALL, "--set", "divergence.repair=true",
                       env={"DPTRAIN_FAULT": "1:5:flip"}, cwd=tmp_path)
    assert repaired.returncode == 0, repaired.stderr
    assert ("warning: replicas diverged at step 6: parameter net.0.weight differs first (1 tensors), rank(s) [1] "
            "off the majority; repaired from rank 0") in repaired.stdout


def test_a_nan_gradient_on_one_rank_skips_the_step_everywhere(tmp_path):
    done = dptrain("run", "--run-dir", str(tmp_path / "run"), *SMALL, env={"DPTRAIN_FAULT": "0:4:nan"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_steps"] == 1  # replicas still agree


@pytest.mark.parametrize("args, message", [
    (["--set", "divergence.every=-1"], "divergence.every must be >= 0 (0: off), got -1"),
    (["--set", "divergence.every=5", "--set", "distributed.strategy=gossip"], "strategy 'gossip' does not keep"),
])
def test_bad_divergence_input_is_refused(tmp_path, args, message):
    done = dptrain("run", "--run-dir", str(tmp_path / "run"), "--set", "task.name=classifier", *args, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_hung_rank_ends_the_job_with_a_timeout_that_names_it(tmp_path):
    """Rank 1 stops calling collectives: rank 0 times out in its all-reduce, and the launcher names rank 1."""
    done = dptrain("run", "--run-dir", str(tmp_path / "run"), *SMALL[:-2], "--set", "distributed.timeout_s=3",
                   env={"DPTRAIN_FAULT": "1:3:hang"}, cwd=tmp_path)
    assert done.returncode == 1
    assert "error: rank 0 failed first" in done.stderr and "Timed out waiting 3000ms" in done.stderr, done.stderr
    assert "rank(s) [1] were still running when the others timed out waiting for them" in done.stderr
    # the worker names it too, through the job's store, so it is named under torchrun and Slurm as well
    assert "roll call: rank(s) [1] reported nothing within 1 s of rank 0's failed collective at step 3" in done.stderr


def test_a_rank_calling_another_collective_is_named_on_every_rank(tmp_path):
    """Rank 1 makes one extra all-reduce at step 3; with every call checked, both ranks stop at once, naming it."""
    done = dptrain("run", "--run-dir", str(tmp_path / "run"), *SMALL[:-2], "--set", 'distributed.check_collectives="every"',
                   "--fault", "1:3:mismatch", cwd=tmp_path)
    assert done.returncode == 1
    for rank in (0, 1):
        error = json.loads((tmp_path / "run" / "logs" / f"rank{rank}.error.json").read_text())["traceback"]
        assert "CollectiveMismatchError: collective #2 differs across ranks: rank(s) [0]: all_reduce(float32[" \
               in error, error
        assert "rank(s) [1]: all_reduce(float32[1]) for a metric only rank 1 computes" in error


def test_a_rank_killed_inside_the_gradient_all_reduces_ends_the_job_with_its_name(tmp_path):
    done = dptrain("run", "--run-dir", str(tmp_path / "run"), *SMALL[:-2], "--fault", "1:3:kill-in-backward",
                   cwd=tmp_path)
    assert done.returncode == 1
    assert "error: rank 1 failed first:\nexited with signal SIGKILL" in done.stderr, done.stderr
    assert re.search(r"\(rank 0 also failed: .*Connection (reset|closed) by peer", done.stderr), done.stderr
