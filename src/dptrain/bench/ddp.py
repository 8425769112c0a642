"""Benchmark: dptrain's DDP against torch's DDP, the naive baseline and no communication.

One run trains the same ~16M-parameter MLP on every variant, interleaved: each round
runs a few steps of every variant, in an order shuffled anew each round (the same on
every rank), so slow phases of a shared machine and position effects hit all variants
alike. The dptrain/torch ratio at a bucket size is computed *per round*, from steps
taken minutes apart at most, and the report gives the median of those paired ratios
with a bootstrap 90% interval over rounds. Variants:

- ``no_comm``: the bare module, no gradient sync (the compute floor);
- ``naive``: one all-reduce per parameter after backward (the communication floor);
- ``torch_ddp/<cap>``: ``torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=cap)``;
- ``dptrain_ddp/<cap>``: ``dptrain.DistributedDataParallel(bucket_cap_mb=cap)``;
- with ``--views``, also ``torch_ddp_view/<cap>`` and ``dptrain_ddp_view/<cap>``: the same
  with ``gradient_as_bucket_view=True`` (no copy of the reduced bucket back to ``.grad``);
- with ``--last-bucket MB`` and/or ``--in-backward``, also ``dptrain_ddp_sched/<cap>``: dptrain with
  ``last_bucket_cap_mb=MB`` (the gradients ready last in a small bucket of their own) and/or
  ``optimizer_in_backward`` (each bucket stepped as its all-reduce completes; the step's ``opt.step()``
  then has nothing left to do), against ``torch_ddp/<cap>``;
- with ``--check-every``, also ``dptrain_ddp_every/<cap>``: every bucket's all-reduce
  fingerprinted across ranks through the store (``check_collectives="every"``), compared
  with ``dptrain_ddp/<cap>``, which checks each bucket's first reduction only (the default).

A step is zero_grad, forward, MSE loss, backward (with the sync), SGD step; its time is
the slowest rank's. Timings are meaningful only side by side within one run. Workers
run with :func:`dptrain.allocator.tune_cpu_allocator` (``--default-malloc`` to turn it
off): with glibc's defaults every step page-faults its gradients back in, which costs
all variants alike but adds noise that depends on heap layout, not on the engine.

Two regimes (``--model``): the default MLP of a few large parameters (16M parameters in
16 tensors: the step is compute and bandwidth), and ``small-params``, blocks of
Linear + LayerNorm (with ``--width 64 --depth 200``, 800 tensors, 0.86M parameters in
all: the step is work per parameter, as in a transformer's many norms and biases, and on
a GPU in every model). The table gives each variant's time above ``no_comm`` per
parameter tensor.

``--held-out`` (or ``--pairs`` with any model) runs another protocol, one dptrain/torch pair per bucket size
built one after another, each deleted before the next (issue 38's held-out setting; ``dptrain.bench.ddp_pairs``).

    python -m dptrain.bench.ddp --world-size 2 --rounds 10
    dptrain bench ddp --held-out
    dptrain bench ddp --model small-params --width 64 --depth 200 --micro-batch 8 --caps 25 --views
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch import nn

from dptrain.bench.ddp_models import MODELS, bucket_mib, build_model
from dptrain.bench.stats import bootstrap_ci
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.ddp import DistributedDataParallel, NaiveDataParallel
from dptrain.testing import run_on_ranks


def _wrap(variant: str, module: nn.Module, last_bucket_mb: float | None = None) -> nn.Module:
    """The variant's model (``dptrain_ddp_sched``'s optimizer_in_backward is registered with its optimizer)."""
    kind, _, cap = variant.partition("/")
    if kind == "no_comm":
        return module
    if kind == "naive":
        return NaiveDataParallel(module)
    engine, _, suffix = kind.partition("_ddp")
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=float(cap),
                                                   gradient_as_bucket_view=suffix == "_view")
    return DistributedDataParallel(module, bucket_cap_mb=float(cap), gradient_as_bucket_view=suffix == "_view",
                                   check_collectives="every" if suffix == "_every" else "first",
                                   last_bucket_cap_mb=last_bucket_mb if suffix == "_sched" else None)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def _bench_rank(rank: int, world_size: int, args: dict) -> dict:
    variants = args["variants"]
    torch.manual_seed(0)
    reference = build_model(args["width"], args["depth"], args["model"])
    models, opts = {}, {}
    for variant in reversed(variants) if args.get("reverse_build") else variants:  # where each one's memory lies
        module = build_model(args["width"], args["depth"], args["model"])
        module.load_state_dict(reference.state_dict())
        models[variant] = _wrap(variant, module, args.get("last_bucket_mb"))
        opts[variant] = torch.optim.SGD(models[variant].parameters(), lr=1e-4)
        if variant.startswith("dptrain_ddp_sched") and args.get("in_backward"):
            models[variant].optimizer_in_backward(opts[variant])
    x = torch.randn(args["micro_batch"], args["width"], generator=torch.Generator().manual_seed(rank))
    for variant in variants:  # warm-up: torch DDP rebuilds its buckets after step 1
        for _ in range(args["warmup"]):
            _step(models[variant], opts[variant], x)
    buckets = {v: bucket_mib(models[v]) for v in variants if "ddp" in v}
    times: dict[str, list[list[float]]] = {v: [] for v in variants}  # [round][step]
    for round_index in range(args["rounds"]):
        order = list(variants)
        random.Random(round_index).shuffle(order)  # same seed, same order on every rank
        for variant in order:
            times[variant].append([])
            for _ in range(args["steps"]):
                dist.barrier()
                start = time.perf_counter()
                _step(models[variant], opts[variant], x)
                times[variant][-1].append(time.perf_counter() - start)
    return {"times": times, "buckets": buckets}


def run(world_size: int, width: int, depth: int, micro_batch: int, caps: list[float], rounds: int,
        steps: int, warmup: int, threads: int, views: bool = False, tune_allocator: bool = True,
        check_every: bool = False, model: str = "mlp", last_bucket_mb: float | None = None,
        in_backward: bool = False, reverse_build: bool = False) -> dict:
    variants = ["no_comm", "naive"]
    pairs = [("dptrain_ddp", "torch_ddp")] + ([("dptrain_ddp_view", "torch_ddp_view")] if views else [])
    pairs += [("dptrain_ddp_every", "dptrain_ddp")] if check_every else []
    pairs += [("dptrain_ddp_sched", "torch_ddp")] if last_bucket_mb is not None or in_backward else []
    for cap in caps:
        for ours, theirs in pairs:
            variants += [v for v in (f"{theirs}/{cap:g}", f"{ours}/{cap:g}") if v not in variants]
    args = dict(variants=variants, width=width, depth=depth, micro_batch=micro_batch,
                rounds=rounds, steps=steps, warmup=warmup, model=model, last_bucket_mb=last_bucket_mb,
                in_backward=in_backward, reverse_build=reverse_build)
    per_rank = run_on_ranks(_bench_rank, world_size, args, timeout=7200, threads_per_rank=threads,
                            tune_allocator=tune_allocator)
    # A step takes as long as its slowest rank.
    step_times = {v: [[max(r["times"][v][k][i] for r in per_rank) for i in range(steps)] for k in range(rounds)]
                  for v in variants}
    medians = {v: statistics.median(t for rnd in per_round for t in rnd) for v, per_round in step_times.items()}
    ratios = {}
    for cap in caps:
        for ours_kind, theirs_kind in pairs:
            ours, theirs = step_times[f"{ours_kind}/{cap:g}"], step_times[f"{theirs_kind}/{cap:g}"]
            paired = [statistics.median(a) / statistics.median(b) for a, b in zip(ours, theirs, strict=True)]
            ratios[f"{ours_kind}/{cap:g}"] = {"median": statistics.median(paired), "ci90": bootstrap_ci(paired),
                                              "against": f"{theirs_kind}/{cap:g}"}
    built = build_model(width, depth, model)
    params = sum(p.numel() for p in built.parameters())
    return {
        "config": dict(world_size=world_size, width=width, depth=depth, params=params, micro_batch=micro_batch,
                       model=model, tensors=len(list(built.parameters())),
                       rounds=rounds, steps_per_round=steps, threads_per_rank=threads, backend="gloo",
                       tuned_allocator=tune_allocator, last_bucket_mb=last_bucket_mb, in_backward=in_backward,
                       built="reversed" if reverse_build else "listed",
                       torch=torch.__version__, cpus=os.cpu_count(), machine=platform.machine()),
        "median_step_s": medians,
        "ratios": ratios,
        "buckets_mib": per_rank[0]["buckets"],
        "step_times_s": step_times,
    }


def to_markdown(result: dict) -> str:
    cfg, med = result["config"], result["median_step_s"]
    floor = med["no_comm"]
    tensors = cfg.get("tensors", 2 * cfg["depth"])
    shape = {"mlp": f"{cfg['depth']} x Linear({cfg['width']})",
             "small-params": f"{cfg['depth']} x (Linear({cfg['width']}) + LayerNorm({cfg['width']}))",
             "mlp-ffn": f"{cfg['depth']} x (Linear({cfg['width']}, {4 * cfg['width']}), GELU, "
                        f"Linear({4 * cfg['width']}, {cfg['width']}))"}[cfg.get("model", "mlp")]
    lines = [f"{cfg['params'] / 1e6:.2f}M parameters in {tensors} tensors ({shape}), "
             f"world size {cfg['world_size']}, gloo, {cfg['threads_per_rank']} thread per rank, micro-batch "
             f"{cfg['micro_batch']}; median of {cfg['rounds']} rounds x {cfg['steps_per_round']} steps, "
             f"{'tuned' if cfg['tuned_allocator'] else 'default'} glibc malloc, torch {cfg['torch']}.", "",
             "| variant | median step (ms) | vs no_comm | above no_comm, µs per parameter tensor |",
             "|---|---:|---:|---:|"]
    for variant, seconds in med.items():
        lines.append(f"| {variant} | {seconds * 1e3:.2f} | {seconds / floor:.2f}x | "
                     f"{(seconds - floor) * 1e6 / tensors:.1f} |")
    lines += ["", "| dptrain variant | against | ratio of step times (median of per-round ratios) "
              "| 90% interval |", "|---|---|---:|---:|"]
    for variant, ratio in result["ratios"].items():
        low, high = ratio["ci90"]
        against = ratio.get("against", variant.replace("dptrain", "torch"))
        lines.append(f"| {variant} | {against} | {ratio['median']:.3f} | {low:.3f} - {high:.3f} |")
    lines += ["", "| variant | buckets (MiB, launch order) |", "|---|---|"]
    for variant, sizes in result.get("buckets_mib", {}).items():
        lines.append(f"| {variant} | {', '.join(f'{s:g}' for s in sizes) or 'not available'} |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--world-size", type=int, default=2, help="ranks (processes on this machine)")
@click.option("--held-out", is_flag=True,
              help="issue 38's held-out setting (--pairs --model mlp-ffn --width 512 --depth 8 --micro-batch 64 "
              "--caps 1 4 25 --rounds 12 --steps 4; options given explicitly win): see dptrain.bench.ddp_pairs")
@click.option("--pairs", is_flag=True,
              help="one dptrain/torch pair per cap, built in --caps order, each deleted before the next, ABBA")
@click.option("--between", type=click.Choice(("none", "gc", "trim")), default="none",
              help="--pairs: what runs between pairs (gc.collect; trim: that and malloc_trim(0))")
@click.option("--model", type=click.Choice(MODELS), default="mlp",
              help="mlp: a few large parameters; small-params: Linear + LayerNorm blocks (try --width 64 "
              "--depth 200 --micro-batch 8); mlp-ffn: transformer feed-forward blocks")
@click.option("--width", type=int, default=1408, help="features per layer")
@click.option("--depth", type=int, default=8, help="layers (blocks for small-params)")
@click.option("--micro-batch", type=int, default=32, help="samples per rank per step")
@click.option("--caps", cls=Variadic, type=float, default=(1, 4, 25), help="bucket sizes in MiB")
@click.option("--rounds", type=int, default=20, help="rounds; each runs every variant in a shuffled order")
@click.option("--steps", type=int, default=2, help="steps per variant per round")
@click.option("--warmup", type=int, default=3, help="untimed steps per variant before the rounds")
@click.option("--threads", type=int, default=1, help="torch threads per rank")
@click.option("--views", is_flag=True, help="also compare gradient_as_bucket_view=True")
@click.option("--last-bucket", type=float, default=None, metavar="MB",
              help="dptrain_ddp_sched: last_bucket_cap_mb=MB, timed against torch")
@click.option("--in-backward", is_flag=True, help="dptrain_ddp_sched: optimizer_in_backward, timed against torch")
@click.option("--check-every", is_flag=True, help="also time check_collectives='every' against the default (first)")
@click.option("--default-malloc", is_flag=True, help="keep glibc's default malloc settings (see dptrain.allocator)")
@click.option("--reverse-build", is_flag=True,
              help="build the variants last to first (each cap's dptrain engine before torch's): which engine is "
              "built first places its memory and moved a ratio by about 9 points (docs/benchmarks.md); run both "
              "(not with --pairs, which builds one pair at a time)")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/ddp.json"),
              help="the JSON result (raw step times) to write")
def main(world_size: int, held_out: bool, pairs: bool, between: str, model: str, width: int, depth: int,
         micro_batch: int, caps: tuple[float, ...], rounds: int, steps: int, warmup: int, threads: int, views: bool,
         check_every: bool, last_bucket: float | None, in_backward: bool, default_malloc: bool, reverse_build: bool,
         out: Path) -> None:
    if held_out or pairs:
        from dptrain.bench import ddp_pairs

        given = dict(model=model, width=width, depth=depth, micro_batch=micro_batch, caps=caps, rounds=rounds,
                     steps=steps)
        if held_out:  # the held-out setting, except for the options given on the command line
            ctx = click.get_current_context()
            given = {k: v if ctx.get_parameter_source(k) is click.core.ParameterSource.COMMANDLINE
                     else ddp_pairs.HELD_OUT[k] for k, v in given.items()}
        result = ddp_pairs.run(world_size, given["model"], given["width"], given["depth"], given["micro_batch"],
                               list(given["caps"]), given["rounds"], given["steps"], warmup, threads,
                               not default_malloc, between)
        text = ddp_pairs.to_markdown(result)
        out = out.with_name("ddp_pairs.json") if out == Path("bench_results/ddp.json") else out
    else:
        result = run(world_size, width, depth, micro_batch, list(caps), rounds, steps, warmup, threads,
                     views, not default_malloc, check_every, model, last_bucket, in_backward, reverse_build)
        text = to_markdown(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(text)
    print(f"\nraw step times: {out}")


if __name__ == "__main__":
    main()
