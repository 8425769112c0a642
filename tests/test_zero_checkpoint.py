"""Sharded ZeRO checkpoints: save on N ranks, load on M, continue exactly; bad checkpoints named.

The resharding test trains 3 Adam steps at world size 2 and saves; a fresh model with
different initial weights loads the checkpoint at world size 1 or 3 and trains 3 more
steps on the same global batches. Its losses must equal those of an uninterrupted run
at world size 2 (the global batch, and so the mean loss, is the same at every world
size; only the order of the gradient sums differs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from _models import HIDDEN, OUT, Layer, build, global_batch, loss_fn
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO
from dptrain.zero.checkpoint import (
    ShardedCheckpointError,
    consolidated_state,
    export_safetensors,
    load_sharded,
    save_sharded,
)
from dptrain.zero.redistribute import chunk_intervals, chunk_rows, transfers, zero_intervals

GLOBAL, FIRST, TOTAL = 12, 3, 6


def _wrap(model: nn.Module, stage: int, shard_size: int | None = None) -> ZeRO:
    return ZeRO(model, stage=stage, shard_size=shard_size,
                **({"unit_classes": (Layer,)} if stage == 3 else {"bucket_cap_mb": 0.001}))


def _train(rank: int, world_size: int, stage: int, steps: range, save: str | None, load: str | None,
           seed: int = 0, shard_size: int | None = None) -> list[float]:
    torch.manual_seed(seed)
    model = _wrap(build("stack"), stage, shard_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if load:
        assert load_sharded(load, model, optimizer, extra={"step": -1})["step"] == steps.start
    micro = GLOBAL // world_size
    losses = []
    for step in steps:
        x, y = global_batch("stack", step, GLOBAL)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn("stack", model(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    if save:
        save_sharded(save, model, optimizer, extra={"step": steps.stop})
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_save_at_2_load_at_1_and_3_continues_like_an_uninterrupted_run(stage: int, tmp_path: Path) -> None:
    uninterrupted = run_on_ranks(_train, 2, stage, range(TOTAL), None, None, timeout=60)[0]
    path = str(tmp_path / "ckpt")
    first = run_on_ranks(_train, 2, stage, range(FIRST), path, None, timeout=60)[0]
    assert first == pytest.approx(uninterrupted[:FIRST], rel=1e-6)
    assert not (tmp_path / "ckpt.tmp").exists()
    for world_size in (1, 3):
        resumed = run_on_ranks(_train, world_size, stage, range(FIRST, TOTAL), None, path, 7, timeout=60)
        for rank_losses in resumed:
            assert rank_losses == pytest.approx(uninterrupted[FIRST:], rel=1e-5), (world_size, rank_losses)
    # without the optimizer state the continuation differs: the test would see a lost exp_avg
    fresh = run_on_ranks(_train, 1, stage, range(FIRST, TOTAL), None, None, timeout=60)[0]
    assert not fresh == pytest.approx(uninterrupted[FIRST:], rel=1e-3)


def test_hybrid_sharded_checkpoints_reshard_to_and_from_plain_zero(tmp_path: Path) -> None:
    # Replicas hold the same shards: DCP writes each piece once. Saved by HSDP (2 shard
    # groups of 2), the checkpoint loads into plain ZeRO-3 at 2 ranks and into HSDP again;
    # saved by plain ZeRO-3, it loads into HSDP.
    uninterrupted = run_on_ranks(_train, 2, 3, range(TOTAL), None, None, timeout=60)[0]
    hybrid, plain = str(tmp_path / "hybrid"), str(tmp_path / "plain")
    first = run_on_ranks(_train, 4, 3, range(FIRST), hybrid, None, 0, 2, timeout=60)[0]
    assert first == pytest.approx(uninterrupted[:FIRST], rel=1e-5)
    run_on_ranks(_train, 2, 3, range(FIRST), plain, None, timeout=60)
    for world_size, shard_size, path in ((2, None, hybrid), (4, 2, hybrid), (4, 2, plain)):
        resumed = run_on_ranks(_train, world_size, 3, range(FIRST, TOTAL), None, path, 7, shard_size, timeout=60)
        for rank_losses in resumed:
            assert rank_losses == pytest.approx(uninterrupted[FIRST:], rel=1e-5), (world_size, path, rank_losses)


def _export(rank: int, world_size: int, stage: int, path: str) -> dict:
    torch.manual_seed(0)
    model = _wrap(build("stack"), stage)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = global_batch("stack", 0, 2 * world_size)
    loss_fn("stack", model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
    optimizer.step()
    save_sharded(path + "/dcp", model, optimizer)
    export_safetensors(model, path + "/model.safetensors")
    return model.gathered_state()


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidated_export_and_offline_read_hold_the_full_weights(stage: int, tmp_path: Path) -> None:
    gathered = run_on_ranks(_export, 3, stage, str(tmp_path), timeout=60)[0]
    exported = load_file(str(tmp_path / "model.safetensors"))
    offline = consolidated_state(tmp_path / "dcp")
    reference = build("stack")
    assert set(exported) == set(offline) == set(gathered) == {n for n, _ in reference.named_parameters()}
    for name, p in reference.named_parameters():
        assert exported[name].shape == offline[name].shape == p.shape
        assert torch.equal(exported[name], gathered[name]) and torch.equal(offline[name], gathered[name])


class _Wider(nn.Module):
    """``stack`` with a different head shape and one renamed parameter."""

    def __init__(self):
        super().__init__()
        base = build("stack")
        self.inp, self.layers = base.inp, base.layers
        self.head = nn.Linear(HIDDEN, OUT + 1)
        self.extra = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) + self.extra(h)


def _load_into_wider(rank: int, world_size: int, path: str) -> str:
    model = _wrap(_Wider(), 3)
    optimizer = torch.optim.Adam(model.parameters())
    try:
        load_sharded(path, model, optimizer)
    except ShardedCheckpointError as e:
        return str(e)
    return "loaded"


def test_mismatched_names_and_shapes_are_named_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train, 2, 3, range(1), path, None, timeout=60)
    messages = run_on_ranks(_load_into_wider, 2, path, timeout=60)
    for message in messages:
        assert "missing from the checkpoint: extra.bias, extra.weight" in message, message
        assert "head.weight (checkpoint (3, 12), model (4, 12))" in message, message
        assert "head.bias (checkpoint (3,), model (4,))" in message, message


def test_a_directory_that_is_no_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ShardedCheckpointError, match="not a dptrain sharded checkpoint: it has no .metadata"):
        consolidated_state(tmp_path)


def write_old_format(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """A checkpoint in the format dptrain wrote before DTensor (its keys: flattened parameters, JSON shapes)."""
    sd = {"shapes": json.dumps({k: list(v.shape) for k, v in weights.items()}), "optim.kinds": "{}",
          "optim.groups": "[]", **{f"model.{k}": v.reshape(-1) for k, v in weights.items()}}
    with pytest.warns(UserWarning, match="assuming the intent is to save in a single process"):
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)


def _load_old(rank: int, world_size: int, path: str) -> str:
    model = _wrap(build("stack"), 2)
    try:
        load_sharded(path, model, torch.optim.Adam(model.parameters()))
    except ShardedCheckpointError as e:
        return str(e)
    return "loaded"


def test_the_older_format_is_refused_with_what_to_do_and_still_consolidated(tmp_path: Path) -> None:
    weights = dict(build("stack").named_parameters())
    path = tmp_path / "step_00000003" / "sharded"
    write_old_format(path, {k: v.detach() for k, v in weights.items()})
    for message in run_on_ranks(_load_old, 2, str(path), timeout=60):
        assert f"{path} is in the sharded format dptrain wrote before DTensor checkpoints" in message, message
        assert f"dptrain consolidate {path.parent}" in message, message
    offline = consolidated_state(path)
    assert set(offline) == set(weights) and all(torch.equal(offline[k], weights[k]) for k in weights)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_the_interval_exchange_delivers_every_element_once_both_ways(world_size: int) -> None:
    """Pure layout arithmetic, no process group: ZeRO's flat shards <-> Shard(0) row chunks, simulated."""
    shapes = [torch.Size(s) for s in ([3, 4], [5], [], [2, 7], [1, 1], [0, 3], [4, 2, 2])]
    numel = sum(s.numel() for s in shapes)
    flat = torch.arange(numel, dtype=torch.float32)
    zero, chunks = zero_intervals(numel, world_size), chunk_intervals(shapes, world_size)
    sending = chunk_intervals(shapes, world_size, sending=True)
    for source, target in ((zero, chunks), (sending, zero)):
        moved = 0
        for rank in range(world_size):
            _, receives = transfers(source, target, rank)
            got = torch.cat([flat[lo:hi] for per_rank in receives for lo, hi in per_rank] or [flat[:0]])
            want = torch.cat([flat[lo:hi] for lo, hi in target[rank]] or [flat[:0]])
            assert torch.equal(got.sort().values, want), (rank, receives, target[rank])  # each element once
            moved += sum(hi - lo for s, per_rank in enumerate(receives) if s != rank for lo, hi in per_rank)
            for s in range(world_size):  # what s sends rank is what rank receives from s
                assert transfers(source, target, s)[0][rank] == receives[s]
        assert moved <= numel + world_size  # at most once each (the replicated 0-dim one to every rank)
    # the row chunks are torch.chunk's, as DTensor's Shard(0) cuts them
    for shape in shapes:
        if len(shape):
            rows = [chunk_rows(shape[0], world_size, r) for r in range(world_size)]
            assert [b - a for a, b in rows if b > a] == [c.shape[0] for c in torch.empty(shape).chunk(world_size)
                                                         if c.shape[0]]
