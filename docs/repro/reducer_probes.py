"""Two probes of dptrain's reducer against torch's on one rank (docs/benchmarks.md, "A bucket's life against torch's
reducer"): (1) issue 38's feed-forward MLP, forward and backward, without DDP, under torch's DDP, under dptrain's and
under dptrain's with the eager copy of large gradients off, at 1 and 4 MiB buckets, rounds alternated, median ms per
step; (2) the time of one call of dptrain's all-reduce and of torch's ``dist.all_reduce`` on 1,000 floats, on 1 and
2 ranks (us per call).

    python docs/repro/reducer_probes.py
"""

import statistics
import time

import torch
import torch.distributed as dist

from dptrain.testing import run_on_ranks


def _steps(rank: int, world_size: int, cap: float) -> dict[str, float]:
    import dptrain.ddp.reducer as reducer
    from dptrain.bench.ddp_models import build_model
    from dptrain.ddp import DistributedDataParallel

    torch.set_num_threads(1)
    x = torch.randn(32, 512)

    def make(kind: str) -> torch.nn.Module:
        torch.manual_seed(0)
        model = build_model(512, 8, "mlp-ffn")
        if kind == "torch":
            return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        if kind == "no DDP":
            return model
        eager = reducer.EAGER_NUMEL
        reducer.EAGER_NUMEL = (1 << 40) if kind == "dptrain, no eager copy" else eager
        try:
            return DistributedDataParallel(model, bucket_cap_mb=cap)
        finally:
            reducer.EAGER_NUMEL = eager

    models = {k: make(k) for k in ("no DDP", "torch", "dptrain", "dptrain, no eager copy")}
    for m in models.values():
        for _ in range(3):
            m(x).sum().backward()
    times = {k: [] for k in models}
    for r in range(16):
        for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
            t0 = time.perf_counter()
            for _ in range(3):
                models[k](x).sum().backward()
            times[k].append((time.perf_counter() - t0) / 3 * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _calls(rank: int, world_size: int) -> dict[str, float]:
    from dptrain.comm import collectives

    x = torch.zeros(1000)
    out = {}
    for name, fn in (("dptrain's all_reduce", lambda: collectives.all_reduce(x)),
                     ("torch's dist.all_reduce", lambda: dist.all_reduce(x))):
        for _ in range(200):
            fn()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        out[name] = (time.perf_counter() - t0) / 2000 * 1e6
    return out


if __name__ == "__main__":
    for cap in (1, 4):
        steps = run_on_ranks(_steps, 1, cap)[0]
        print(f"{cap} MiB buckets, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
    for world in (1, 2):
        calls = run_on_ranks(_calls, world)[0]
        print(f"{world} rank(s), us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in calls.items()))
