"""The same calls of dptrain's all-reduce path timed inside backward and alone (docs/benchmarks.md, "A bucket's life
against torch's reducer"): issue 38's feed-forward MLP under dptrain's DDP on one rank, 1 MiB buckets; the parts of
``dptrain.comm.collectives.all_reduce`` (``_Call.start``, ``agree``, ``launch``, ``_tensor_problem``, ``_flat``) each
wrapped in a clock, their median us per call over 20 steps' buckets, then over 320 calls of the engine's comm hook on
one bucket outside backward (with and without grad mode).

    python docs/repro/reducer_inside_backward.py
"""

import statistics
import time

import torch

from dptrain.testing import run_on_ranks


def _measure(rank: int, world_size: int) -> tuple[dict, dict, dict]:
    from dptrain.bench.ddp_models import build_model
    from dptrain.comm import collectives
    from dptrain.ddp import DistributedDataParallel
    from dptrain.ddp.comm_hooks import GradBucket

    torch.set_num_threads(1)
    x = torch.randn(32, 512)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(512, 8, "mlp-ffn"), bucket_cap_mb=1)
    spent: dict[str, list[int]] = {}

    def clocked(owner, name: str, is_classmethod: bool = False) -> None:
        original = getattr(owner, name)

        def call(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                spent.setdefault(name, []).append(time.perf_counter_ns() - t0)
        setattr(owner, name, classmethod(lambda cls, *a, **k: call(*a, **k)) if is_classmethod else call)

    clocked(collectives._Call, "start", is_classmethod=True)
    for name in ("agree", "launch"):
        clocked(collectives._Call, name)
    for name in ("_tensor_problem", "_flat"):
        clocked(collectives, name)

    def medians() -> dict[str, float]:
        out = {k: statistics.median(v) / 1e3 for k, v in spent.items()}
        spent.clear()
        return out

    reducer = model.reducer
    for _ in range(3):
        model(x).sum().backward()
    spent.clear()
    for _ in range(20):
        model(x).sum().backward()
    inside = medians()
    bucket = reducer.buckets[0]
    grad_bucket = GradBucket(bucket.index, bucket.buffer, bucket.views, bucket.params, False)
    for _ in range(320):
        reducer.comm_hook(reducer.comm_state, grad_bucket).wait()
    alone = medians()
    with torch.no_grad():
        for _ in range(320):
            reducer.comm_hook(reducer.comm_state, grad_bucket).wait()
    return inside, alone, medians()


if __name__ == "__main__":
    inside, alone, no_grad = run_on_ranks(_measure, 1)[0]
    for name in inside:
        print(f"{name:16s} inside backward {inside[name]:6.1f} us, alone {alone[name]:5.1f} us, "
              f"alone under no_grad {no_grad[name]:5.1f} us")
