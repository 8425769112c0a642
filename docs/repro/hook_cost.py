"""What a Python gradient hook costs by itself (docs/benchmarks.md, "A bucket's life against torch's reducer"):
issue 38's feed-forward MLP (16.8M parameters, 32 of them), forward and backward on one thread, without hooks, with
a no-op post-accumulate-grad hook or tensor hook on every parameter, and with a hook that copies each gradient into
a buffer of its own (one pass over the gradients, as a reducer's copy into its buckets); rounds alternated, the
median ms per step of each.

    python docs/repro/hook_cost.py
"""

import statistics
import time

import torch

from dptrain.bench.ddp_models import build_model

torch.set_num_threads(1)
x = torch.randn(32, 512)


def _copy(buffer: torch.Tensor, grad: torch.Tensor) -> None:
    buffer.copy_(grad)


def make(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_model(512, 8, "mlp-ffn")
    buffers = {p: torch.empty_like(p) for p in m.parameters()}
    for p in m.parameters():
        if kind == "no-op hook":
            p.register_post_accumulate_grad_hook(lambda p: None)
        elif kind == "no-op tensor hook":
            p.register_hook(lambda g: None)
        elif kind == "copying hook":
            p.register_post_accumulate_grad_hook(lambda p: _copy(buffers[p], p.grad))
    return m


models = {k: make(k) for k in ("no hook", "no-op hook", "no-op tensor hook", "copying hook")}
for m in models.values():
    for _ in range(3):
        m(x).sum().backward()
times = {k: [] for k in models}
for r in range(15):
    for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
        t0 = time.perf_counter()
        for _ in range(3):
            models[k](x).sum().backward()
        times[k].append((time.perf_counter() - t0) / 3 * 1e3)
for k, v in times.items():
    print(f"{k}: {statistics.median(v):.2f} ms per step")
