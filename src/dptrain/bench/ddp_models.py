"""The models the DDP benchmarks train, and the bucket layout a wrapped model ended with.

Shared by ``dptrain bench ddp`` (:mod:`dptrain.bench.ddp`), its pairs mode
(:mod:`dptrain.bench.ddp_pairs`) and the allocator benchmark.
"""

from __future__ import annotations

from torch import nn

from dptrain.ddp import DistributedDataParallel

__all__ = ["MODELS", "build_model", "bucket_mib"]

MODELS = ("mlp", "small-params", "mlp-ffn")


def build_model(width: int, depth: int, kind: str = "mlp") -> nn.Module:
    """``mlp``: ``depth`` x (Linear(width), ReLU), a few large parameters. ``small-params``: ``depth`` x
    (Linear(width), LayerNorm(width)), four small parameters a block: a transformer's shape, where the
    work per parameter, not the bytes, sets the engine's overhead. ``mlp-ffn``: ``depth`` x
    (Linear(width, 4 width), GELU, Linear(4 width, width)), a transformer's feed-forward blocks (issue 38's
    held-out model at width 512, depth 8: 16.8M parameters)."""
    if kind not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {kind!r}")
    layers: list[nn.Module] = []
    for _ in range(depth):
        if kind == "mlp-ffn":
            layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
        else:
            layers += [nn.Linear(width, width), nn.ReLU() if kind == "mlp" else nn.LayerNorm(width)]
    return nn.Sequential(*layers)


def bucket_mib(model: nn.Module) -> list[float]:
    """Bucket sizes in MiB, in launch order, after warm-up (torch rebuilds after step 1)."""
    if isinstance(model, DistributedDataParallel):
        sizes = [b.nbytes for b in model.reducer.buckets]
    else:
        # torch exposes its rebuilt buckets only through a private method; the layout is
        # reported for information, so a torch without it just reports nothing.
        try:
            sizes = [b.buffer().numel() * b.buffer().element_size()
                     for b in model.reducer._get_zeros_like_grad_buckets()]
        except AttributeError:
            return []
    return [round(n / 2**20, 2) for n in sizes]
