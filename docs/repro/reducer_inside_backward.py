"""The same calls of dptrain's all-reduce path timed inside backward and alone (docs/benchmarks.md, "A bucket's life
against torch's reducer"): issue 38's feed-forward MLP under dptrain's DDP on one rank, 1 MiB buckets; the parts of
``dptrain.comm.collectives.all_reduce`` (``_Call.start``, ``agree``, ``launch``, ``_tensor_problem``, ``_flat``) each
wrapped in a clock, their median us per call over 20 steps' buckets, then over 320 calls of the engine's comm hook on
one bucket outside backward (with and without grad mode); then, on a bare 8-layer MLP with a post-accumulate-grad
hook on each parameter, pure-Python work and a few torch and threading calls timed inside the hook and alone.

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


def _plain_hook(rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    import threading

    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    x, t = torch.randn(32, 512), torch.zeros(1000)

    def python_work() -> None:
        d = {}
        for i in range(50):
            d[i] = (i, str(i))

    calls = {"pure Python (50 dict inserts)": python_work, "dist.get_world_size": lambda: dist.get_world_size(),
             "Tensor.view": lambda: t.view(-1), "threading.Event()": threading.Event}
    times = {k: ([], []) for k in calls}

    def run(where: int) -> None:
        for name, fn in calls.items():
            t0 = time.perf_counter_ns()
            fn()
            times[name][where].append(time.perf_counter_ns() - t0)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: run(0))
    for _ in range(20):
        model(x).sum().backward()
    for _ in range(320):
        run(1)
    return {k: (statistics.median(a) / 1e3, statistics.median(b) / 1e3) for k, (a, b) in times.items()}


if __name__ == "__main__":
    inside, alone, no_grad = run_on_ranks(_measure, 1)[0]
    for name in inside:
        print(f"{name:16s} inside backward {inside[name]:6.1f} us, alone {alone[name]:5.1f} us, "
              f"alone under no_grad {no_grad[name]:5.1f} us")
    for name, (inside_us, alone_us) in run_on_ranks(_plain_hook, 1)[0].items():
        print(f"plain hook: {name:30s} inside backward {inside_us:5.2f} us, alone {alone_us:5.2f} us")
