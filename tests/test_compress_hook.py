"""The compression hook in the DDP engine: each codec's reduction against an oracle, fp16/bf16 parity, bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.comm.topology import shard_bounds
from dptrain.compress import Int8, TopK, make_codec
from dptrain.compress.hook import CompressionHook
from dptrain.testing import run_on_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _batch(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)


def _local_grads(rank: int, step: int = 0) -> list[torch.Tensor]:
    model = _model()
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _hooked_grads(rank: int, world_size: int, codec: str, feedback: bool) -> dict:
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    hook = CompressionHook(make_codec(codec, topk_fraction=0.1, int8_chunk=64), error_feedback=feedback)
    model.register_comm_hook(None, hook)
    x, y = _batch(rank)
    nn.functional.mse_loss(model(x), y).backward()
    order = [n for n, _ in model.module.named_parameters()]
    return {"grads": [p.grad.clone() for p in model.module.parameters()], "stats": hook.stats.close_step(),
            "buckets": [[order.index(n) for n in names] for names in model.bucket_assignment]}


def _oracle(codec_name: str, world_size: int, buckets: list[list[int]]) -> list[torch.Tensor]:
    """Every rank's gradients, compressed and reduced as the hook should, computed in one process."""
    codec = make_codec(codec_name, topk_fraction=0.1, int8_chunk=64)
    local = [_local_grads(r) for r in range(world_size)]
    out = [None] * len(local[0])
    for bucket in buckets:
        grads = [torch.cat([local[r][i].reshape(-1) for i in bucket]) for r in range(world_size)]
        flat = [g / world_size for g in grads]
        if isinstance(codec, Int8) and world_size > 2:  # shards exchanged and summed, the sum re-quantised
            parts = []
            for a, b in shard_bounds(flat[0].numel(), world_size):
                total = sum(codec.roundtrip(g[a:b]) / world_size for g in grads)
                parts.append(codec.roundtrip(total))
            reduced = torch.cat(parts)
        elif isinstance(codec, (Int8, TopK)):  # each rank's gradient encoded, 1/N of it decoded and summed
            reduced = sum(codec.roundtrip(g) / world_size for g in grads)
        else:
            reduced = sum(codec.roundtrip(f) for f in flat).to(codec.dtype).float()  # fp32 sum, then the wire dtype
        offset = 0
        for i in bucket:
            n = local[0][i].numel()
            out[i] = reduced[offset:offset + n].view_as(local[0][i])
            offset += n
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_lossy_codecs_reduce_as_the_oracle(codec: str, world_size: int) -> None:
    got = run_on_ranks(_hooked_grads, world_size, codec, False, timeout=120)
    want = _oracle(codec, world_size, got[0]["buckets"])
    for rank in range(world_size):
        for g, w in zip(got[rank]["grads"], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("codec,rtol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_codecs_match_the_uncompressed_engine_within_their_precision(codec: str, rtol: float) -> None:
    got = run_on_ranks(_hooked_grads, 2, codec, False, timeout=120)
    exact = [(a + b) / 2 for a, b in zip(_local_grads(0), _local_grads(1), strict=True)]
    for g, w in zip(got[0]["grads"], exact, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * w.abs().max().item())


@pytest.mark.parametrize("codec,ratio", [("fp16", 2), ("bf16", 2), ("int8", 3.5), ("topk", 4)])
def test_bytes_are_counted_and_smaller(codec: str, ratio: float) -> None:
    stats = run_on_ranks(_hooked_grads, 2, codec, True, timeout=120)[0]["stats"]
    numel = sum(p.numel() for p in _model().parameters())
    assert stats["raw_bytes"] == 4 * numel
    assert stats["raw_bytes"] / stats["payload_bytes"] >= ratio
    assert 0 < stats["sent_bytes"] < stats["raw_bytes"]


def _nan_on_rank_one(rank: int, world_size: int, codec: str) -> bool:
    model = DistributedDataParallel(_model())
    model.register_comm_hook(None, CompressionHook(make_codec(codec), error_feedback=True))
    x, y = _batch(rank)
    if rank == 1:
        x[0, 0] = float("nan")
    nn.functional.mse_loss(model(x), y).backward()
    return all(bool(torch.isfinite(p.grad).all()) for p in model.module.parameters())


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "topk"])
def test_a_nan_gradient_is_never_compressed_into_finite_numbers(codec: str) -> None:
    assert run_on_ranks(_nan_on_rank_one, 2, codec, timeout=120) == [False, False]


def _bad_codec(rank: int, world_size: int) -> str:
    try:
        CompressionHook("int8")
    except TypeError as e:
        return str(e)
    return ""


def test_the_hook_names_what_it_supports() -> None:
    assert "fp16, bf16, int8 and topk" in run_on_ranks(_bad_codec, 1, timeout=60)[0]


def _all_to_all(rank: int, world_size: int) -> list[int]:
    out = torch.empty(3, dtype=torch.int8)
    dist.all_to_all_single(out, torch.full((3,), rank, dtype=torch.int8), [1, 1, 1], [1, 1, 1])
    return out.tolist()


def test_gloo_has_the_collectives_the_hook_needs() -> None:
    assert run_on_ranks(_all_to_all, 3, timeout=60)[2] == [0, 1, 2]


def _powersgd_grads(rank: int, world_size: int, psgd_rank: int) -> dict:
    model = DistributedDataParallel(_model(), bucket_cap_mb=100)  # one bucket
    hook = CompressionHook(make_codec("powersgd", powersgd_rank=psgd_rank))
    model.register_comm_hook(None, hook)
    x, y = _batch(rank)
    with pytest.warns(UserWarning, match="sent uncompressed") if rank == 0 and psgd_rank >= 3 else _nothing():
        nn.functional.mse_loss(model(x), y).backward()
    return {"grads": [p.grad.clone() for p in model.module.parameters()], "stats": hook.stats.close_step()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_powersgd_is_one_power_iteration_of_the_summed_gradient() -> None:
    from dptrain.compress.powersgd import PowerSGD, orthonormalise

    r = 2
    got = run_on_ranks(_powersgd_grads, 2, r, timeout=120)
    local = [_local_grads(0), _local_grads(1)]
    psgd = PowerSGD(r)
    names = [n for n, _ in _model().named_parameters()]
    order = list(reversed(range(len(names))))  # the bucket's parameters in gradient-ready order
    for position, i in enumerate(order):
        shares = [local[w][i] / 2 for w in range(2)]
        if shares[0].dim() < 2:
            want = shares[0] + shares[1]  # vectors travel uncompressed
        else:
            m = [s.view(s.shape[0], -1) for s in shares]
            q0 = psgd.initial_q((0, position), m[0].shape[1])
            p_hat = orthonormalise(m[0] @ q0 + m[1] @ q0)
            q = m[0].t() @ p_hat + m[1].t() @ p_hat
            want = (p_hat @ q.t()).view_as(shares[0])
        for w in range(2):
            torch.testing.assert_close(got[w]["grads"][i], want, rtol=1e-4, atol=1e-6)
    raw, payload = got[0]["stats"]["raw_bytes"], got[0]["stats"]["payload_bytes"]
    assert raw / payload > 4


def test_powersgd_sends_too_small_matrices_uncompressed_and_says_so_once() -> None:
    # rank 3 is not below the last layer's 3 rows: that matrix is sent as it is, averaged exactly
    got = run_on_ranks(_powersgd_grads, 2, 3, timeout=120)
    exact = [(a + b) / 2 for a, b in zip(_local_grads(0), _local_grads(1), strict=True)]
    torch.testing.assert_close(got[0]["grads"][-2], exact[-2])


def test_powersgd_rank_must_be_positive() -> None:
    with pytest.raises(ValueError, match="PowerSGD rank must be a positive integer, got 0"):
        make_codec("powersgd", powersgd_rank=0)


def test_compression_study_runs_and_reports_the_ratio() -> None:
    from _cli import TINY_GPT_SETTINGS
    from dptrain.bench.compression import run, table

    result = run(steps=2, nproc=2, variants=["none", "int8+EF"], overrides=TINY_GPT_SETTINGS)
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["none"]["payload_bytes_per_step"] == rows["none"]["raw_bytes_per_step"]
    assert 3.5 < rows["int8+EF"]["raw_bytes_per_step"] / rows["int8+EF"]["payload_bytes_per_step"] <= 4
    assert "| int8+EF |" in table(result)


def _timed_steps(rank: int, world_size: int, codec: str) -> list[dict]:
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    hook = CompressionHook(make_codec(codec, topk_fraction=0.1, int8_chunk=64))
    model.register_comm_hook(None, hook)
    records = []
    for timed in (False, True):
        hook.stats.timed = timed
        x, y = _batch(rank)
        nn.functional.mse_loss(model(x), y).backward()
        records.append(hook.stats.close_step())
    return records


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk", "powersgd"])
def test_timed_steps_split_the_reduction_into_encode_communicate_decode(codec: str) -> None:
    untimed, timed = run_on_ranks(_timed_steps, 2, codec, timeout=120)[0]
    assert "encode_s" not in untimed
    for kind in ("encode_s", "communicate_s", "decode_s"):
        assert timed[kind] > 0, (kind, timed)


def _loads_share_residuals(rank: int, world_size: int) -> list[torch.Tensor]:
    hook = CompressionHook(make_codec("int8"))
    old = {"feedback": {"residuals": {"0": torch.tensor([1.0, -2.0])}}}  # a checkpoint that kept shares
    hook.load_state_dict(old)
    again = CompressionHook(make_codec("int8"))
    again.load_state_dict(hook.state_dict())  # saved in the gradient's units, loaded as they are
    return [hook.feedback.residuals[0], again.feedback.residuals[0]]


def test_residuals_saved_as_shares_are_loaded_in_the_gradients_units() -> None:
    loaded, reloaded = run_on_ranks(_loads_share_residuals, 2, timeout=60)[0]
    torch.testing.assert_close(loaded, torch.tensor([2.0, -4.0]))  # times N = 2
    torch.testing.assert_close(reloaded, loaded)
