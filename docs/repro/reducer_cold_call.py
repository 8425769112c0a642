"""The engine's default comm hook called alone on one rank, warm and right after work that moves memory (docs/
benchmarks.md, "A bucket's life against torch's reducer"): a 1 MiB bucket of issue 38's feed-forward MLP, 600 calls
each (the first 100 not counted), the median us per call: back to back, after a 32 x 2048 x 512 matrix product, after
a 4 MiB copy, after a 64 MiB copy (the gradients' bytes of one step).

    python docs/repro/reducer_cold_call.py
"""

import statistics
import time

import torch

from dptrain.testing import run_on_ranks


def _measure(rank: int, world_size: int) -> dict[str, float]:
    from dptrain.bench.ddp_models import build_model
    from dptrain.ddp import DistributedDataParallel
    from dptrain.ddp.comm_hooks import GradBucket

    torch.set_num_threads(1)
    model = DistributedDataParallel(build_model(512, 8, "mlp-ffn"), bucket_cap_mb=1)
    reducer = model.reducer
    bucket = reducer.buckets[0]
    grad_bucket = GradBucket(bucket.index, bucket.buffer, bucket.views, bucket.params, False)
    a, w = torch.randn(32, 2048), torch.randn(2048, 512)
    small, big_in, big_out = torch.randn(1 << 20), torch.randn(16 << 20), torch.empty(16 << 20)
    small_out = torch.empty(1 << 20)
    before = {"back to back": None, "after a 32x2048x512 matrix product": lambda: a @ w,
              "after a 4 MiB copy": lambda: small_out.copy_(small), "after a 64 MiB copy": lambda: big_out.copy_(big_in)}
    out = {}
    for label, work in before.items():
        times = []
        for _ in range(600):
            if work is not None:
                work()
            t0 = time.perf_counter_ns()
            reducer.comm_hook(reducer.comm_state, grad_bucket).wait()
            times.append(time.perf_counter_ns() - t0)
        out[label] = statistics.median(times[100:]) / 1e3
    return out


if __name__ == "__main__":
    for label, us in run_on_ranks(_measure, 1)[0].items():
        print(f"the hook's call {label}: {us:.1f} us")
