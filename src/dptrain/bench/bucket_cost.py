"""Benchmark: where a DDP bucket's time goes, dptrain's reducer against torch's C++ reducer, op by op.

The same model (``--model``, issue 38's held-out feed-forward MLP by default) is wrapped
three ways on every rank: not at all (the floor: forward and backward alone), in torch's
``DistributedDataParallel`` and in dptrain's, at each bucket cap. Each round times
``--steps`` forward-backward steps of every variant (no optimizer: the reducer's work is
what differs), in an order reversed every other round; a variant's step is its slowest
rank's. Reported per cap:

- the step of each, and per round the ratio dptrain / torch and the reducer's own time
  over torch's, ``(dptrain - floor) / (torch - floor)``: the medians and a bootstrap 90%
  interval;
- one profiled pass of each (``torch.profiler``, CPU, rank 0): self time per step of the
  ops each reducer runs, in groups: the copies into and out of the buckets (``copy_``,
  ``mul``, ``div_``, the ``_foreach`` kernels), the collectives (``c10d::``), the gradient
  hooks (``AccumulateGrad``'s self time, which holds a Python hook's), and the rest beyond
  the floor's; divided by the buckets, the cost of one bucket's life.

With ``--world-size 1`` nothing is communicated and the difference is the reducers' own
work; at 2 the collectives and their contention with compute are in it too.

    dptrain bench bucket-cost
    dptrain bench bucket-cost --world-size 1 --caps 1 4 25
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dptrain.bench.ddp_models import MODELS, bucket_mib, build_model
from dptrain.bench.stats import bootstrap_ci, paired_ratios
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.ddp import DistributedDataParallel
from dptrain.testing import run_on_ranks

__all__ = ["run", "main", "GROUPS"]

VARIANTS = ("floor", "torch", "dptrain")
# op groups of a profile: a name's group is the first whose prefix it starts with
GROUPS = {"copies": ("aten::copy_", "aten::mul", "aten::div", "aten::_foreach", "aten::zero_", "aten::fill_"),
          "collectives": ("c10d::", "gloo:", "nccl:"), "hooks": ("torch::autograd::AccumulateGrad",)}


def _group(name: str) -> str:
    return next((g for g, prefixes in GROUPS.items() if name.startswith(prefixes)), "rest")


def _build(variant: str, model: nn.Module, cap: float) -> nn.Module:
    if variant == "torch":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    if variant == "dptrain":
        return DistributedDataParallel(model, bucket_cap_mb=cap)
    return model


def _profile(model: nn.Module, x: torch.Tensor, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step of each op group over ``steps`` profiled steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model(x).sum().backward()
    out = dict.fromkeys([*GROUPS, "rest"], 0.0)
    for event in prof.key_averages():
        out[_group(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return out


def _rank(rank: int, world_size: int, args: dict) -> dict:
    torch.set_num_threads(1)
    x = torch.randn(args["micro_batch"], args["width"], generator=torch.Generator().manual_seed(rank))
    out: dict = {}
    for cap in args["caps"]:
        variants = {}
        for v in VARIANTS:
            torch.manual_seed(0)
            variants[v] = _build(v, build_model(args["width"], args["depth"], args["model"]), cap)
        for m in variants.values():
            for _ in range(args["warmup"]):
                m(x).sum().backward()
        times = {v: [] for v in VARIANTS}
        for r in range(args["rounds"]):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args["steps"]):
                    variants[v](x).sum().backward()
                times[v].append((time.perf_counter() - t0) / args["steps"])
        profiles = {}
        for v in VARIANTS:
            dist.barrier()
            profiles[v] = _profile(variants[v], x, args["steps"])
        out[str(cap)] = {"times": times, "profiles": profiles,
                         "buckets": {v: bucket_mib(variants[v]) for v in ("torch", "dptrain")}}
    return out


def run(world_size: int, caps: list[float], model: str, width: int, depth: int, micro_batch: int, rounds: int,
        steps: int, warmup: int) -> dict:
    args = dict(caps=caps, model=model, width=width, depth=depth, micro_batch=micro_batch, rounds=rounds,
                steps=steps, warmup=warmup)
    per_rank = run_on_ranks(_rank, world_size, args, timeout=7200)
    result = {"config": {**args, "world_size": world_size, "torch": torch.__version__, "cpus": os.cpu_count(),
                         "parameters": sum(p.numel() for p in build_model(width, depth, model).parameters())},
              "caps": {}}
    for cap in map(str, caps):
        slowest = {v: [[max(r[cap]["times"][v][i] for r in per_rank)] for i in range(rounds)] for v in VARIANTS}
        own = [[(d[0] - f[0]) / max(t[0] - f[0], 1e-9)] for d, t, f in
               zip(slowest["dptrain"], slowest["torch"], slowest["floor"], strict=True)]
        buckets = per_rank[0][cap]["buckets"]
        result["caps"][cap] = {
            "median_step_ms": {v: 1e3 * statistics.median(t[0] for t in slowest[v]) for v in VARIANTS},
            "dptrain_over_torch": paired_ratios(slowest["dptrain"], slowest["torch"]),
            "reducer_over_torchs": {"median": statistics.median(o[0] for o in own),
                                    "ci90": bootstrap_ci([o[0] for o in own])},
            "profile_ms_per_step": per_rank[0][cap]["profiles"], "buckets": buckets,
            "step_times_s": slowest}
    return result


def table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"{cfg['model']} width {cfg['width']} depth {cfg['depth']} ({cfg['parameters'] / 1e6:.1f}M parameters), "
             f"micro-batch {cfg['micro_batch']}, {cfg['world_size']} rank(s), {cfg['rounds']} rounds x {cfg['steps']} "
             "forward-backward steps per variant; ms per step", "",
             "| cap MiB | buckets (dptrain, torch) | floor | torch | dptrain | dptrain / torch (90% interval) | "
             "dptrain's reducer / torch's (90% interval) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for cap, c in result["caps"].items():
        med, ratio, own = c["median_step_ms"], c["dptrain_over_torch"], c["reducer_over_torchs"]
        lines.append(f"| {cap} | {len(c['buckets']['dptrain'])}, {len(c['buckets']['torch'])} | {med['floor']:.1f} | "
                     f"{med['torch']:.1f} | {med['dptrain']:.1f} | {ratio['median']:.3f} ({ratio['ci90'][0]:.3f}-"
                     f"{ratio['ci90'][1]:.3f}) | {own['median']:.3f} ({own['ci90'][0]:.3f}-{own['ci90'][1]:.3f}) |")
    lines += ["", "Profiled self time, ms per step (rank 0, one pass each), and per bucket beyond the floor:", "",
              "| cap MiB | variant | " + " | ".join(GROUPS) + " | rest | per bucket beyond the floor |",
              "|---:|---|" + "---:|" * (len(GROUPS) + 2)]
    for cap, c in result["caps"].items():
        prof = c["profile_ms_per_step"]
        floor = sum(prof["floor"].values())
        for v in ("torch", "dptrain"):
            n = max(1, len(c["buckets"][v]))
            beyond = 1e3 * (sum(prof[v].values()) - floor) / n
            lines.append(f"| {cap} | {v} | " + " | ".join(f"{prof[v][g]:.2f}" for g in [*GROUPS, "rest"])
                         + f" | {beyond:.0f} us |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--world-size", type=int, default=2, help="ranks (processes on this machine)")
@click.option("--caps", cls=Variadic, type=float, help="bucket caps in MiB (default: 1 4 25)")
@click.option("--model", type=click.Choice(MODELS), default="mlp-ffn", show_default=True)
@click.option("--width", type=int, default=512, show_default=True)
@click.option("--depth", type=int, default=8, show_default=True)
@click.option("--micro-batch", type=int, default=32, show_default=True)
@click.option("--rounds", type=int, default=12, show_default=True)
@click.option("--steps", type=int, default=3, show_default=True, help="steps per variant per round")
@click.option("--warmup", type=int, default=3, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/bucket_cost.json"))
def main(world_size: int, caps: tuple[float, ...], model: str, width: int, depth: int, micro_batch: int, rounds: int,
         steps: int, warmup: int, out: Path) -> None:
    result = run(world_size, list(caps) or [1.0, 4.0, 25.0], model, width, depth, micro_batch, rounds, steps, warmup)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"raw numbers: {out}")


if __name__ == "__main__":
    main()
