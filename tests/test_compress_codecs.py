"""Gradient codecs and error feedback: round-trip error bounds, wire sizes, non-finite values. No process group."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.compress import ErrorFeedback, Half, Int8, TopK, make_codec


def _grad(n: int = 10_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-4, 1, n)[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("dtype,bits", [(torch.float16, 11), (torch.bfloat16, 8)])
def test_half_round_trip_is_within_half_an_ulp(dtype: torch.dtype, bits: int) -> None:
    x = _grad()
    codec = Half(dtype)
    payload = codec.encode(x)
    assert payload.nbytes == codec.wire_bytes(x.numel()) == 2 * x.numel()
    normal = x.abs() > (6.2e-5 if dtype == torch.float16 else 1.2e-38)  # fp16's subnormals lose relative precision
    rel = ((codec.decode(payload) - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -bits


@pytest.mark.parametrize("n,chunk", [(10_000, 1024), (1000, 7), (5, 1024)])
def test_int8_error_is_at_most_half_a_step_of_its_chunk(n: int, chunk: int) -> None:
    x = _grad(n)
    codec = Int8(chunk)
    payload = codec.encode(x)
    assert payload.tensors[0].dtype == torch.int8
    assert payload.nbytes == codec.wire_bytes(n) == n + 4 * math.ceil(n / chunk)
    err = (codec.decode(payload) - x).abs()
    for start in range(0, n, chunk):
        step = x[start:start + chunk].abs().max() / 127
        assert err[start:start + chunk].max() <= step / 2 * (1 + 1e-6)


def test_int8_keeps_zeros_exact_and_non_finite_chunks_non_finite() -> None:
    x = torch.zeros(3000)
    x[5] = float("nan")
    x[2100] = float("inf")
    x[1500] = 3.0
    out = Int8(1000).roundtrip(x)
    assert torch.isnan(out[:1000]).all() and torch.isnan(out[2000:]).all()  # the chunks with NaN and inf
    assert out[1500] == 3.0 and (out[1000:1500] == 0).all()  # a finite chunk decodes as before


def test_topk_keeps_the_largest_exactly_and_nothing_else() -> None:
    x = _grad(1000)
    codec = TopK(0.05)
    payload = codec.encode(x)
    assert codec.k(1000) == 50 and payload.nbytes == codec.wire_bytes(1000) == 50 * 8
    out = codec.decode(payload)
    kept = out != 0
    assert kept.sum() == 50
    assert torch.equal(out[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_topk_sends_non_finite_values_first() -> None:
    x = torch.arange(100.0)
    x[3], x[7] = float("nan"), float("-inf")
    out = TopK(0.02).roundtrip(x)
    assert torch.isnan(out[3]) and out[7] == float("-inf")


def test_error_feedback_delays_but_loses_nothing() -> None:
    # Gradients with a steady part (what training needs) under per-step noise. Exactly:
    # the sum of what was sent == the sum of the gradients - the last residual.
    codec, ef = TopK(0.02), ErrorFeedback()
    gen = torch.Generator().manual_seed(0)
    steady = torch.rand(500, generator=gen) * 0.1
    grads = [steady + 0.3 * torch.randn(500, generator=gen) for _ in range(200)]
    sent = torch.zeros(500)
    for g in grads:
        sent += codec.decode(ef.encode(0, g, codec))
    total = torch.stack(grads).sum(0)
    assert torch.allclose(sent + ef.residuals[0], total, atol=1e-3)
    plain = sum(codec.roundtrip(g) for g in grads)  # without feedback the steady part is mostly never sent
    assert (total - sent).norm() < 0.25 * (total - plain).norm()


def test_error_feedback_resets_rather_than_keeps_a_non_finite_residual() -> None:
    codec, ef = Int8(16), ErrorFeedback()
    bad = torch.ones(64)
    bad[0] = float("nan")
    ef.encode("b", bad, codec)
    assert torch.equal(ef.residuals["b"], torch.zeros(64))
    ef.encode("b", torch.ones(64) * 0.3, codec)
    assert torch.isfinite(ef.residuals["b"]).all()


def test_error_feedback_state_round_trips() -> None:
    codec, ef = TopK(0.1), ErrorFeedback()
    ef.encode(3, _grad(100), codec)
    restored = ErrorFeedback()
    restored.load_state_dict(ef.state_dict())
    assert list(restored.residuals) == [3] and torch.equal(restored.residuals[3], ef.residuals[3])


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="topk", topk_fraction=0.0), r"top-k fraction must be in \(0, 1\], got 0.0"),
    (dict(name="topk", topk_fraction=1.5), r"got 1.5"),
    (dict(name="int8", int8_chunk=0), "at least 1 element"),
    (dict(name="int4"), "unknown codec 'int4'"),
])
def test_bad_codec_arguments_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_codec(**kwargs)


@pytest.mark.parametrize("codec,numel", [(Int8(64), 256), (Int8(64), 250), (TopK(0.1), 256)])
def test_encoding_keeping_the_error_leaves_x_minus_the_decoded_payload(codec, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 4
    want_payload = codec.encode(x)
    want_error = x - codec.decode(want_payload)
    y = x.clone()
    payload = codec.encode_keeping_error_(y)
    for a, b in zip(payload.tensors, want_payload.tensors, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(y, want_error, rtol=0, atol=1e-6)


def test_a_non_finite_chunk_leaves_a_non_finite_error_for_feedback_to_reset():
    x = torch.randn(128)
    x[70] = float("nan")
    Int8(64).encode_keeping_error_(x)
    assert torch.isfinite(x[:64]).all() and torch.isnan(x[64:]).all()
