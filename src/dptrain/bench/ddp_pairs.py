"""Benchmark mode: dptrain's DDP against torch's, one pair of models per bucket size, built one after another.

``dptrain bench ddp --held-out`` (issue 38's held-out setting): a 16.8M-parameter MLP of
8 x [Linear(512, 2048), GELU, Linear(2048, 512)] (``--model mlp-ffn``), micro-batch 64,
SGD, world size 2, gloo, one thread per rank. In one process group, for each bucket size
in the order given (1, 4, 25 MiB), a pair of models is built (dptrain's DDP and torch's,
from the same weights), warmed up, timed, and deleted before the next pair is built: as a
training process that builds an evaluation copy, re-wraps a model or runs a sweep does.
Within a pair the two engines alternate ABBA (round ``r`` runs dptrain first when ``r`` is
even, torch first when odd), ``--steps`` steps each per round; the ratio is per round,
median(dptrain) / median(torch), summarised by its median and a bootstrap 90% interval.
After the pairs, the bare module is timed alone (the no-communication floor); it comes
last so that the pairs are built exactly as in the held-out setting.

``--between gc`` (``gc.collect()``) or ``--between trim`` (that, then glibc's
``malloc_trim(0)``) runs between pairs, and ``--caps 25 1 4`` builds the 25 MiB pair
first: the measurements behind docs/benchmarks.md's section on the 25 MiB regression.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import platform
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from dptrain.bench.ddp_models import bucket_mib, build_model
from dptrain.bench.stats import paired_ratios
from dptrain.ddp import DistributedDataParallel
from dptrain.testing import run_on_ranks

__all__ = ["HELD_OUT", "ENGINES", "BETWEEN", "abba", "run", "to_markdown"]

# The held-out setting's options, as `dptrain bench ddp` names them.
HELD_OUT = dict(model="mlp-ffn", width=512, depth=8, micro_batch=64, caps=(1.0, 4.0, 25.0), rounds=12, steps=4)
ENGINES = ("dptrain", "torch")
BETWEEN = ("none", "gc", "trim")


def abba(round_index: int) -> tuple[str, str]:
    """The engines' order in round ``round_index``: dptrain, torch; then torch, dptrain; and so on.

    Over two rounds each engine runs once first and once second (A B B A), so a drift
    within a round (caches, the other rank, the machine) costs both engines alike.
    """
    return ENGINES if round_index % 2 == 0 else ENGINES[::-1]


def _wrap(engine: str, module: nn.Module, cap: float) -> nn.Module:
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap)
    return DistributedDataParallel(module, bucket_cap_mb=cap)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def _timed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, faults: list[int]) -> float:
    """One step's seconds; its minor page faults (this process, every thread) are appended to ``faults``."""
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    _step(model, opt, x)
    elapsed = time.perf_counter() - start
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return elapsed


def _release(between: str) -> None:
    """What runs after a pair is deleted (``--between``): nothing, a collection, or a collection and a trim."""
    if between in ("gc", "trim"):
        gc.collect()
    if between == "trim":
        path = ctypes.util.find_library("c")
        if path is not None:
            ctypes.CDLL(path).malloc_trim(0)


def _time_pair(cap: float, reference: nn.Module, args: dict, x: torch.Tensor) -> tuple[dict, dict]:
    """Build one pair at ``cap``, warm it up, time it ABBA; returns ({engine: [round][step]}, bucket MiB)."""
    models, opts = {}, {}
    for engine in ENGINES:
        module = build_model(args["width"], args["depth"], args["model"])
        module.load_state_dict(reference.state_dict())
        models[engine] = _wrap(engine, module, cap)
        opts[engine] = torch.optim.SGD(models[engine].parameters(), lr=1e-4)
    for engine in ENGINES:  # warm-up: torch DDP rebuilds its buckets after step 1
        for _ in range(args["warmup"]):
            _step(models[engine], opts[engine], x)
    times: dict[str, list[list[float]]] = {engine: [] for engine in ENGINES}
    faults: dict[str, list[int]] = {engine: [] for engine in ENGINES}
    for round_index in range(args["rounds"]):
        for engine in abba(round_index):
            times[engine].append([_timed_step(models[engine], opts[engine], x, faults[engine])
                                  for _ in range(args["steps"])])
    return times, {"buckets": {engine: bucket_mib(models[engine]) for engine in ENGINES},
                   "faults": {engine: statistics.median(f) for engine, f in faults.items()}}


def _pairs_rank(rank: int, world_size: int, args: dict) -> dict:
    torch.manual_seed(0)
    reference = build_model(args["width"], args["depth"], args["model"])
    x = torch.randn(args["micro_batch"], args["width"], generator=torch.Generator().manual_seed(rank))
    times, facts = {}, {}
    for cap in args["caps"]:
        times[f"{cap:g}"], facts[f"{cap:g}"] = _time_pair(cap, reference, args, x)  # the pair is freed here
        _release(args["between"])
        facts[f"{cap:g}"]["rss_mib_after"] = _rss_mib()  # what the deleted pair left resident
    bare = build_model(args["width"], args["depth"], args["model"])
    bare.load_state_dict(reference.state_dict())
    opt = torch.optim.SGD(bare.parameters(), lr=1e-4)
    for _ in range(args["warmup"]):
        _step(bare, opt, x)
    floor = [[_timed_step(bare, opt, x, []) for _ in range(args["steps"])] for _ in range(args["rounds"])]
    return {"times": times, "floor": floor, "facts": facts}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def slowest_rank(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """A step takes as long as its slowest rank: the elementwise max of per-rank [round][step] times."""
    return [[max(steps) for steps in zip(*rounds, strict=True)] for rounds in zip(*per_rank, strict=True)]


def run(world_size: int, model: str, width: int, depth: int, micro_batch: int, caps: list[float], rounds: int,
        steps: int, warmup: int, threads: int, tune_allocator: bool = True, between: str = "none") -> dict:
    if between not in BETWEEN:
        raise ValueError(f"between must be one of {BETWEEN}, got {between!r}")
    args = dict(model=model, width=width, depth=depth, micro_batch=micro_batch, caps=caps, rounds=rounds,
                steps=steps, warmup=warmup, between=between)
    per_rank = run_on_ranks(_pairs_rank, world_size, args, timeout=7200, threads_per_rank=threads,
                            tune_allocator=tune_allocator)
    step_times = {cap: {engine: slowest_rank([r["times"][cap][engine] for r in per_rank]) for engine in ENGINES}
                  for cap in per_rank[0]["times"]}
    floor = slowest_rank([r["floor"] for r in per_rank])
    built = build_model(width, depth, model)
    return {
        "config": dict(world_size=world_size, model=model, width=width, depth=depth, micro_batch=micro_batch,
                       params=sum(p.numel() for p in built.parameters()), tensors=len(list(built.parameters())),
                       caps=caps, rounds=rounds, steps_per_round=steps, threads_per_rank=threads, backend="gloo",
                       tuned_allocator=tune_allocator, between=between, torch=torch.__version__,
                       cpus=os.cpu_count(), machine=platform.machine()),
        "ratios": {cap: paired_ratios(t["dptrain"], t["torch"]) for cap, t in step_times.items()},
        "median_step_s": {cap: {e: _median(t[e]) for e in ENGINES} for cap, t in step_times.items()},
        "floor_s": _median(floor),
        "buckets_mib": {cap: facts["buckets"] for cap, facts in per_rank[0]["facts"].items()},
        "faults_per_step": {cap: {e: max(r["facts"][cap]["faults"][e] for r in per_rank) for e in ENGINES}
                            for cap in step_times},
        "rss_mib_after": {cap: max(r["facts"][cap]["rss_mib_after"] for r in per_rank) for cap in step_times},
        "step_times_s": step_times,
        "floor_times_s": floor,
    }


def _median(per_round: list[list[float]]) -> float:
    return statistics.median(t for steps in per_round for t in steps)


def to_markdown(result: dict) -> str:
    cfg, floor = result["config"], result["floor_s"]
    lines = [f"{cfg['params'] / 1e6:.2f}M parameters in {cfg['tensors']} tensors ({cfg['model']}, width "
             f"{cfg['width']}, depth {cfg['depth']}), world size {cfg['world_size']}, gloo, {cfg['threads_per_rank']} "
             f"thread per rank, micro-batch {cfg['micro_batch']}; one pair per bucket size, built in the order "
             f"{', '.join(f'{c:g}' for c in cfg['caps'])} MiB, each deleted before the next (between pairs: "
             f"{cfg['between']}); {cfg['rounds']} ABBA rounds x {cfg['steps_per_round']} steps, "
             f"{'tuned' if cfg['tuned_allocator'] else 'default'} glibc malloc, torch {cfg['torch']}.", "",
             "| bucket MiB | dptrain step (ms) | torch step (ms) | dptrain / torch (median of per-round ratios) "
             "| 90% interval | dptrain vs no_comm | torch vs no_comm | page faults per step, dptrain / torch "
             "| resident MiB after the pair is deleted | buckets (MiB, dptrain) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for cap, ratio in result["ratios"].items():
        med, faults = result["median_step_s"][cap], result["faults_per_step"][cap]
        low, high = ratio["ci90"]
        sizes = ", ".join(f"{s:g}" for s in result["buckets_mib"][cap]["dptrain"])
        lines.append(f"| {cap} | {med['dptrain'] * 1e3:.1f} | {med['torch'] * 1e3:.1f} | {ratio['median']:.3f} "
                     f"| {low:.3f} - {high:.3f} | {med['dptrain'] / floor:.2f}x | {med['torch'] / floor:.2f}x "
                     f"| {faults['dptrain']:g} / {faults['torch']:g} | {result['rss_mib_after'][cap]:.0f} | {sizes} |")
    lines += ["", f"no-communication floor (the bare module, timed after the pairs): {floor * 1e3:.1f} ms a step"]
    return "\n".join(lines)
