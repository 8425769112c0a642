"""Where dptrain's DDP spends its time per parameter: 200 x (Linear(64) + LayerNorm(64)), 800 tensors.

    python docs/repro/ddp_small_params.py profile [--view] [--steps 50]
    python docs/repro/ddp_small_params.py views [--rounds 20]
    python docs/repro/ddp_small_params.py hooks [--view] [--rounds 100]

``profile``: one rank (gloo, world size 1, one thread), dptrain's DDP with one 25 MiB
bucket, SGD, micro-batch 8: the median step of 100 steps for dptrain and for torch's
DDP (one after the other, not interleaved: for orientation only), then cProfile of
dptrain's next ``--steps`` steps, sorted by own time. docs/benchmarks.md quotes the
hook's and the copies' time per parameter from it, before and after the batched copy
(run it with ``PYTHONPATH=<checkout>/src`` to profile another commit: it uses only the
engine's public constructor).

``views``: world size 2, the no-wrapper floor and both engines with
``gradient_as_bucket_view=True`` only, interleaved as ``dptrain bench ddp`` does
(``_bench_rank``), and the dptrain/torch ratio of per-round medians with its 90%
interval: the bucket-view comparison without the other variants in the process.

``hooks``: one rank, one thread; the backward of the bare model, of the model with a
do-nothing hook on every parameter (a list's C ``append``: autograd's own cost of a
Python hook), of dptrain's DDP and of torch's, interleaved; the median time each spends
above the bare backward, per parameter tensor (hooks, bucket copies, the world-size-1
all-reduce and the copy out). The same ``PYTHONPATH`` trick compares commits.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def build(width: int = 64, depth: int = 200) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers)


def _median_step(model: nn.Module, steps: int, profile: bool = False) -> tuple[float, str]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(8, 64)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    for _ in range(5):
        step()
    times = []
    for _ in range(100):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    report = ""
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        report = out.getvalue()
    return statistics.median(times), report


def _one_rank() -> None:
    """A world of one gloo rank, one thread, seeded."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)


def profile(view: bool, steps: int) -> None:
    from dptrain.ddp import DistributedDataParallel

    _one_rank()
    theirs = nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=25, gradient_as_bucket_view=view)
    ours = DistributedDataParallel(build(), bucket_cap_mb=25, gradient_as_bucket_view=view)
    t_theirs, _ = _median_step(theirs, steps)
    t_ours, report = _median_step(ours, steps, profile=True)
    print(f"median step, one rank{', bucket views' if view else ''}: torch DDP {t_theirs * 1e3:.2f} ms, "
          f"dptrain DDP {t_ours * 1e3:.2f} ms (not interleaved)\n")
    print(f"dptrain, {steps} steps of 800 parameters ({steps * 800:,} gradient hooks):")
    print(report)
    dist.destroy_process_group()


def views(rounds: int) -> None:
    from dptrain.bench.ddp import _bench_rank
    from dptrain.bench.stats import paired_ratios
    from dptrain.testing import run_on_ranks

    variants = ["no_comm", "torch_ddp_view/25", "dptrain_ddp_view/25"]
    args = dict(variants=variants, width=64, depth=200, micro_batch=8, rounds=rounds, steps=5, warmup=3,
                model="small-params")
    per_rank = run_on_ranks(_bench_rank, 2, args, timeout=3600, threads_per_rank=1, tune_allocator=True)
    times = {v: [[max(r["times"][v][k][i] for r in per_rank) for i in range(5)] for k in range(rounds)]
             for v in variants}
    ratio = paired_ratios(times["dptrain_ddp_view/25"], times["torch_ddp_view/25"])
    low, high = ratio["ci90"]
    print(f"dptrain_ddp_view/25 / torch_ddp_view/25, {rounds} rounds x 5 steps: median {ratio['median']:.3f}, "
          f"90% interval {low:.3f} - {high:.3f}")


def hooks(view: bool, rounds: int) -> None:
    from dptrain.ddp import DistributedDataParallel

    _one_rank()
    log: list[torch.Tensor] = []
    with_hook = build()
    for p in with_hook.parameters():
        p.register_post_accumulate_grad_hook(log.append)
    models = {"bare": build(), "do-nothing hook": with_hook,
              "dptrain DDP": DistributedDataParallel(build(), bucket_cap_mb=25, gradient_as_bucket_view=view),
              "torch DDP": nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=25,
                                                               gradient_as_bucket_view=view)}
    x = torch.randn(8, 64)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 5):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            log.clear()
            loss = model(x).pow(2).mean()
            start = time.perf_counter()
            loss.backward()
            if r >= 5:
                times[name].append(time.perf_counter() - start)
    bare = statistics.median(times["bare"])
    print(f"backward, one rank, 800 parameter tensors{', bucket views' if view else ''}, median of {rounds}:")
    for name, t in times.items():
        print(f"  {name:16s} {statistics.median(t) * 1e3:6.2f} ms   above bare: "
              f"{(statistics.median(t) - bare) / 800 * 1e6:5.2f} us per parameter")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("profile")
    p.add_argument("--view", action="store_true")
    p.add_argument("--steps", type=int, default=50)
    v = sub.add_parser("views")
    v.add_argument("--rounds", type=int, default=20)
    h = sub.add_parser("hooks")
    h.add_argument("--view", action="store_true")
    h.add_argument("--rounds", type=int, default=100)
    a = parser.parse_args()
    if a.what == "profile":
        profile(a.view, a.steps)
    elif a.what == "views":
        views(a.rounds)
    else:
        hooks(a.view, a.rounds)
