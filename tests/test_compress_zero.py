"""ZeRO's compressed reduce-scatter: every stage and codec against an oracle, bytes, refused codecs, a NaN."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.comm.topology import shard_bounds
from dptrain.compress import make_codec
from dptrain.compress.zero import ShardedCompression
from dptrain.testing import run_on_ranks
from dptrain.zero import ZeRO

pytestmark = pytest.mark.timeout(180)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _batch(rank: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)


def _local_grads(rank: int) -> dict[str, torch.Tensor]:
    model = _model()
    x, y = _batch(rank)
    nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _zero_grads(rank: int, world_size: int, stage: int, codec: str, feedback: bool) -> dict:
    """Each unit's gradient shard after one step of compressed ZeRO, beside what the oracle says it must be."""
    compression = ShardedCompression(make_codec(codec, int8_chunk=16), error_feedback=feedback)
    kwargs = dict(min_unit_numel=1000) if stage == 3 else dict(bucket_cap_mb=0.01)
    model = ZeRO(_model(), stage=stage, compression=compression, **kwargs)
    x, y = _batch(rank)
    nn.functional.mse_loss(model(x), y).backward()
    oracle_codec = make_codec(codec, int8_chunk=16)
    local = [_local_grads(r) for r in range(world_size)]
    got, want = [], []
    for unit in model.units:
        flat = [torch.cat([local[r][ref.name].reshape(-1) for ref in unit.refs]) / world_size
                for r in range(world_size)]
        a, b = shard_bounds(unit.numel, world_size)[rank]
        assert (a, b) == (unit.lo, unit.hi)
        want.append(sum(oracle_codec.roundtrip(f[a:b]) for f in flat))
        got.append(unit.shard.grad.clone())
    return {"got": got, "want": want, "stats": compression.stats.close_step(),
            "numel": sum(u.numel for u in model.units)}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_each_shard_is_the_sum_of_every_ranks_decoded_shard(stage: int, codec: str) -> None:
    for result in run_on_ranks(_zero_grads, 3, stage, codec, False, timeout=150):
        assert len(result["got"]) > 1
        for g, w in zip(result["got"], result["want"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("codec,ratio", [("fp16", 2), ("int8", 3)])
def test_bytes_are_counted_and_smaller(codec: str, ratio: float) -> None:
    result = run_on_ranks(_zero_grads, 2, 2, codec, True, timeout=150)[0]
    stats = result["stats"]
    assert stats["raw_bytes"] == 4 * result["numel"]
    assert stats["raw_bytes"] / stats["payload_bytes"] >= ratio
    # a direct exchange: each rank sends the shards it does not own, about half the payload at 2 ranks
    assert 0.4 * stats["payload_bytes"] < stats["sent_bytes"] < 0.6 * stats["payload_bytes"]


def _refused(rank: int, world_size: int, codec: str) -> str:
    try:
        ShardedCompression(make_codec(codec))
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("codec", ["topk", "powersgd"])
def test_codecs_without_a_reduce_scatter_are_refused_by_name(codec: str) -> None:
    message = run_on_ranks(_refused, 2, codec, timeout=60)[0]
    assert codec in message and "fp16, bf16, int8" in message and "strategy ddp" in message


def _nan_on_rank_one(rank: int, world_size: int, codec: str) -> bool:
    model = ZeRO(_model(), stage=2, compression=ShardedCompression(make_codec(codec), error_feedback=True))
    x, y = _batch(rank)
    if rank == 1:
        x[0, 0] = float("nan")
    nn.functional.mse_loss(model(x), y).backward()
    return all(bool(torch.isfinite(u.shard.grad).all()) for u in model.units)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_nan_gradient_stays_non_finite_on_every_rank(codec: str) -> None:
    assert run_on_ranks(_nan_on_rank_one, 2, codec, timeout=120) == [False, False]
