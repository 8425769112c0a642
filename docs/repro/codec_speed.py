"""The codecs' hot paths against their naive forms, on one CPU thread (docs/compression.md, "The hook").

    python docs/repro/codec_speed.py

Each line: median milliseconds of the naive form and of dptrain's, same input.
"""

from __future__ import annotations

import statistics
import time

import torch

from dptrain.compress import make_codec
from dptrain.compress.codecs import _top_indices
from dptrain.compress.powersgd import project


def ms(fn, repeat: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def naive_int8(x: torch.Tensor, chunk: int = 1024):
    """Divide by the scale, find non-finite chunks element by element, clamp."""
    blocks = x.view(-1, chunk)
    absmax = blocks.abs().amax(dim=1)
    finite = torch.isfinite(blocks).all(dim=1)
    scale = torch.where(finite, absmax / 127.0, torch.full_like(absmax, float("nan")))
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    q = torch.round(torch.where(finite[:, None], blocks, torch.zeros_like(blocks)) / safe[:, None])
    return q.clamp_(-127, 127).to(torch.int8), scale


def residual_by_decoding(codec, x: torch.Tensor):
    """Encode, decode into a new tensor, subtract: error feedback's residual the general way."""
    payload = codec.encode(x)
    x.sub_(codec.decode(payload))
    return payload


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(4096 * 1024)
    int8 = make_codec("int8")
    k = x.numel() // 100
    m, q, p = torch.randn(2048, 512), torch.randn(512, 4), torch.randn(2048, 4)
    rows = [
        ("int8 encode, 4M elements", lambda: naive_int8(x), lambda: int8.encode(x)),
        ("top-k 1% indices, 4M elements", lambda: torch.topk(x.abs(), k, sorted=False), lambda: _top_indices(x.abs(), k)),
        ("M @ Q, 2048 x 512, r = 4", lambda: m @ q, lambda: project(m, q)),
        ("M^T @ P, 2048 x 512, r = 4", lambda: m.t() @ p, lambda: project(m.t(), p)),
        ("finite check, 4M elements", lambda: bool(torch.isfinite(x).all()), lambda: bool(torch.isfinite(x.sum()))),
        ("int8 encode + error-feedback residual, 4M", lambda: residual_by_decoding(int8, x.clone()),
         lambda: int8.encode_keeping_error_(x.clone())),
    ]
    same = set(torch.topk(x.abs(), k).indices.tolist()) == set(_top_indices(x.abs(), k).tolist())
    print(f"torch {torch.__version__}, 1 thread; top-k picks the same indices: {same} "
          "(the last row's times include copying the 4M input)")
    print("| operation | naive, ms | dptrain, ms |\n|---|---:|---:|")
    for name, naive, ours in rows:
        print(f"| {name} | {ms(naive):.2f} | {ms(ours):.2f} |")


if __name__ == "__main__":
    main()
