"""What one Python call per bucket costs inside torch's own reducer: the floor of any Python reducer
(docs/benchmarks.md, "The price of Python per bucket, measured in torch's reducer").

torch's ``DistributedDataParallel`` runs each bucket's communication through a comm hook: its
built-in ``ALLREDUCE`` hook is C++ (divide the bucket by the world size, all-reduce it), and a
registered Python hook is called from the C++ reducer with the GIL taken. The same reducer with
the same work in a C++ hook and in a Python one differs only by the Python call per bucket, made
at the point in backward where dptrain's Python hooks run (right after a bucket's gradients
passed through the cache). Variants, on issue 38's feed-forward MLP (width 512, depth 8, 16.8M
parameters; or the model named), forward and backward only, every cap's variants in one order rotated every
round:

- ``floor``: no DDP;
- ``torch``: torch's DDP as it comes (C++, the division fused into the copy in);
- ``torch, C++ hook``: torch's DDP with the built-in ``ALLREDUCE`` comm hook;
- ``torch, Python hook``: torch's DDP with a Python hook doing the same two operations
  (``buffer.div_``, the process group's ``allreduce``) and nothing else;
- ``dptrain``: dptrain's DDP.

Per cap, the median step of each and the medians (90% bootstrap intervals) of per-round ratios:
Python hook / C++ hook (the price of the Python call alone), dptrain / torch, dptrain / Python
hook (what dptrain's bookkeeping costs beyond the minimal Python hook).

    [BUILD=reversed] python docs/repro/python_hook_floor.py [WORLD_SIZE] [ROUNDS] [MODEL WIDTH DEPTH]   # defaults 2, 12, mlp-ffn 512 8
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dptrain.bench.ddp_models import build_model
from dptrain.bench.stats import paired_ratios
from dptrain.ddp import DistributedDataParallel
from dptrain.testing import run_on_ranks

VARIANTS = ("floor", "torch", "torch, C++ hook", "torch, Python hook", "dptrain")
CAPS = (1.0, 4.0, 25.0)
STEPS = 3


def _python_allreduce(state: tuple[dist.ProcessGroup, float], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The built-in ALLREDUCE hook's two operations, in Python: divide, then all-reduce."""
    group, size = state
    buffer = bucket.buffer()
    buffer.div_(size)
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _build(variant: str, cap: float, shape: tuple[str, int, int]) -> torch.nn.Module:
    torch.manual_seed(0)
    kind, width, depth = shape
    model = build_model(width, depth, kind)
    if variant == "floor":
        return model
    if variant == "dptrain":
        return DistributedDataParallel(model, bucket_cap_mb=cap)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    if variant == "torch, C++ hook":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif variant == "torch, Python hook":
        group = dist.group.WORLD
        ddp.register_comm_hook((group, float(dist.get_world_size(group))), _python_allreduce)
    return ddp


def _rank(rank: int, world_size: int, rounds: int, shape: tuple[str, int, int]) -> dict:
    torch.set_num_threads(1)
    x = torch.randn(32, shape[1], generator=torch.Generator().manual_seed(rank))
    # every (cap, variant) built and warmed first, then each round runs them all in an order rotated by one: the
    # caps interleaved too, so that no cap is the one measured first in the process (until 2026-12-07 the caps ran
    # one after another, and the first, 1 MiB, came out dptrain / torch 1.07-1.08 in three runs of four)
    keys = [(cap, v) for cap in CAPS for v in VARIANTS]
    # the order they are built in places their memory, and that moved dptrain / torch by about 9 points between
    # identical engines (BUILD=reversed builds the last cap's first; docs/benchmarks.md)
    built = list(reversed(keys)) if os.environ.get("BUILD") == "reversed" else keys
    models = {(cap, v): _build(v, cap, shape) for cap, v in built}
    for m in models.values():
        for _ in range(3):
            m(x).sum().backward()
    out = {cap: {v: [] for v in VARIANTS} for cap in CAPS}
    for r in range(rounds):
        shift = r % len(keys)
        for cap, v in keys[shift:] + keys[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                models[cap, v](x).sum().backward()
            out[cap][v].append((time.perf_counter() - t0) / STEPS)
    return out


def _ratio(a: list[float], b: list[float]) -> str:
    r = paired_ratios([[x] for x in a], [[y] for y in b])
    return f"{r['median']:.3f} ({r['ci90'][0]:.3f}-{r['ci90'][1]:.3f})"


def main() -> None:
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    shape = (sys.argv[3], int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else ("mlp-ffn", 512, 8)
    per_rank = run_on_ranks(_rank, world_size, rounds, shape, timeout=3600)
    params = sum(p.numel() for p in build_model(shape[1], shape[2], shape[0]).parameters())
    print(f"{shape[0]} width {shape[1]} depth {shape[2]} ({params / 1e6:.1f}M parameters), {world_size} rank(s), {rounds} rounds x {STEPS} forward-backward steps per variant, torch "
          f"{torch.__version__}; ms per step (the slowest rank's)\n")
    print("| cap MiB | " + " | ".join(VARIANTS) + " | Python hook / C++ hook | dptrain / torch | "
          "dptrain / Python hook |")
    print("|---:|" + "---:|" * (len(VARIANTS) + 3))
    for cap in CAPS:
        slowest = {v: [max(r[cap][v][i] for r in per_rank) for i in range(rounds)] for v in VARIANTS}
        steps = " | ".join(f"{1e3 * statistics.median(slowest[v]):.1f}" for v in VARIANTS)
        print(f"| {cap:g} | {steps} | {_ratio(slowest['torch, Python hook'], slowest['torch, C++ hook'])} | "
              f"{_ratio(slowest['dptrain'], slowest['torch'])} | "
              f"{_ratio(slowest['dptrain'], slowest['torch, Python hook'])} |")


if __name__ == "__main__":
    main()
