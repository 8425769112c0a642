"""Where a DDP step's time goes, torch's engine and dptrain's side by side: a Chrome trace and a table.

The same MLP is trained by every variant (no communication, torch's DDP, dptrain's DDP, and
dptrain's with its scheduling options), each for a few steps after a warm-up, on every rank.
For each step the variant's spans are recorded the same way for both engines:

- forward; backward up to its last gradient (a post-accumulate-grad hook on every parameter;
  the latest one is when backward's computation ended); the wait after it (what backward
  returned later: exposed communication); the optimizer;
- each bucket's all-reduce, from launch to completion: a communication hook that calls
  torch's default all-reduce hook and stamps the completion in its future's callback,
  registered on both engines alike (so both pay the same Python call per bucket);
- and, alone on a quiet group, one all-reduce of each of the engine's bucket sizes: what
  the communication costs when nothing computes beside it.

``bench_results/ddp_timeline.json`` is a Chrome trace (open it in chrome://tracing or
https://ui.perfetto.dev): a process per variant, a compute and a communication row per
rank. The table compares backward's computation with and without communication beside it:
where it stretches by about the isolated all-reduce time, the communication was not hidden
but time-shared with the computation (the CPU cores are the shared resource), and no
scheduling of the all-reduces can give that time back.

With ``--compile BACKEND`` every variant trains ``DDP(torch.compile(model))`` (nanoGPT's order; no
communication: ``torch.compile(model)``). A compiled region is one autograd node, so its gradients land
together when its backward ends; dynamo's DDPOptimizer splits it at bucket boundaries for both engines
(dptrain's: ``ddp/compiled.py``). The table then says where, within backward's computation, the first
all-reduce started, and how many started before it ended.

    dptrain bench ddp-timeline
    dptrain bench ddp-timeline --model mlp-ffn --width 512 --micro-batch 64 --cap 25
    dptrain bench ddp-timeline --compile inductor --cap 4
"""

from __future__ import annotations

import json
import statistics
import time
import types
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from dptrain.bench.ddp_models import MODELS, build_model
from dptrain.cli.bench_group import bench_command
from dptrain.comm.step_stats import union_length
from dptrain.ddp import DistributedDataParallel
from dptrain.testing import run_on_ranks

VARIANTS = ("no_comm", "torch_ddp", "dptrain_ddp", "dptrain_ddp_sched")


def _timed_allreduce(spans: list):
    """torch's default all-reduce hook, with each bucket's [launch, completion] appended to ``spans``."""

    def hook(group, bucket):
        span = [time.perf_counter(), None]
        spans.append(span)

        def done(fut):
            span[1] = time.perf_counter()
            return fut.value()[0]

        return allreduce_hook(group, bucket).then(done)

    return hook


class _Compiled(nn.Module):
    """A variant's model behind a forward whose code object is the variant's own (:func:`_compile`)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _compile(module: nn.Module, backend: str, variant: str) -> nn.Module:
    """``torch.compile`` of ``module`` for one variant. Dynamo caches a compiled graph per code object and does not
    guard on whether a DDP forward is running (for torch's class neither), so variants of one model class would all
    run the graph of whichever compiled first, split at bucket boundaries or not; a copy of the forward's code
    object per variant keeps their graphs apart."""
    wrapper = _Compiled(module)
    code = _Compiled.forward.__code__.replace(co_name=f"forward_{variant}")
    wrapper.forward = types.MethodType(types.FunctionType(code, globals()), wrapper)
    return torch.compile(wrapper, backend=backend)


def _wrap(variant: str, module: nn.Module, cap: float, last_mb: float, backend: str) -> nn.Module:
    if backend != "none":
        module = _compile(module, backend, variant)
    if variant == "no_comm":
        return module
    if variant == "torch_ddp":
        return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap)
    return DistributedDataParallel(module, bucket_cap_mb=cap,
                                   last_bucket_cap_mb=last_mb if variant == "dptrain_ddp_sched" else None)


def _rank(rank: int, world_size: int, args: dict) -> dict:
    torch._dynamo.config.optimize_ddp = args.get("optimize_ddp", True)
    x = torch.randn(args["micro_batch"], args["width"], generator=torch.Generator().manual_seed(rank))
    built = {}
    for variant in VARIANTS:  # all built first, then stepped in turn, so a busy moment hits them alike
        torch.manual_seed(0)
        module = build_model(args["width"], args["depth"], args["model"])
        model = _wrap(variant, module, args["cap"], args["last_mb"], args["compile"])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        spans: list = []
        if variant != "no_comm":
            model.register_comm_hook(dist.group.WORLD, _timed_allreduce(spans))
        if variant == "dptrain_ddp_sched":
            model.optimizer_in_backward(opt)
        landed: list[float] = []  # when each gradient landed (the earliest and latest are kept)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda _, t=landed: t.append(time.perf_counter()))
        built[variant] = (model, opt, spans, landed)
    out: dict = {"steps": {v: [] for v in VARIANTS}, "isolated": {}, "buckets": {}}
    for step in range(args["warmup"] + args["steps"]):
        shift = step % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:  # rotated each step, the same on every rank
            model, opt, spans, landed = built[variant]
            dist.barrier()
            spans.clear()
            landed.clear()
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if step >= args["warmup"]:
                out["steps"][variant].append({"start": t0, "forward_end": t1, "first_grad": min(landed),
                                              "last_grad": max(landed), "backward_end": t2, "end": t3,
                                              "comm": [list(s) for s in spans]})
    for variant, (model, *_) in built.items():
        if variant != "no_comm":
            sizes = _bucket_numels(model)
            out["buckets"][variant] = sizes
            out["isolated"][variant] = [_isolated_allreduce(n) for n in sizes]
    return out


def _bucket_numels(model: nn.Module) -> list[int]:
    if isinstance(model, DistributedDataParallel):
        return [b.numel for b in model.reducer.buckets]
    return [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]  # torch: private, bench only


def _isolated_allreduce(numel: int, repeats: int = 5) -> float:
    tensor = torch.ones(numel)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def summarise(per_rank: list[dict]) -> dict[str, dict[str, float]]:
    """Per variant, medians over steps of the slowest rank's spans, in ms."""
    rows = {}
    for variant in VARIANTS:
        steps = list(zip(*(r["steps"][variant] for r in per_rank), strict=True))

        def med(f, steps=steps) -> float:
            return 1e3 * statistics.median(max(f(s) for s in ranks) for ranks in steps)

        row = {"forward": med(lambda s: s["forward_end"] - s["start"]),
               "backward compute": med(lambda s: s["last_grad"] - s["forward_end"]),
               "wait after backward": med(lambda s: s["backward_end"] - s["last_grad"]),
               "optimizer": med(lambda s: s["end"] - s["backward_end"]),
               "step": med(lambda s: s["end"] - s["start"])}
        if variant != "no_comm":
            row["comm busy"] = med(lambda s: union_length([(a, b) for a, b in s["comm"] if b is not None]))
            row["isolated all-reduces"] = 1e3 * max(sum(r["isolated"][variant]) for r in per_rank)
            row.update(_launches(steps))
        rows[variant] = row
    return rows


def _launches(steps: list[tuple[dict, ...]]) -> dict[str, float]:
    """Where the first gradient landed and the first all-reduce started within backward's computation (forward's
    end to the last gradient), in percent of it (the latest rank's), and how many all-reduces started before the
    last gradient landed (the fewest of any rank); medians over steps. A compiled graph that is not split lands
    all its gradients after all its computation, together: its first gradient lands late."""
    def percent(s: dict, when: float) -> float:
        return 100 * (when - s["forward_end"]) / max(s["last_grad"] - s["forward_end"], 1e-9)

    def first(s: dict) -> float:
        return percent(s, min(a for a, _ in s["comm"]))

    def before(s: dict) -> int:
        return sum(a < s["last_grad"] for a, _ in s["comm"])

    with_comm = [ranks for ranks in steps if all(s["comm"] for s in ranks)]
    if not with_comm:
        return {}
    return {"first gradient, % of backward": statistics.median(max(percent(s, s.get("first_grad", s["last_grad"]))
                                                                   for s in r) for r in with_comm),
            "first all-reduce, % of backward": statistics.median(max(first(s) for s in r) for r in with_comm),
            "all-reduces started in backward": statistics.median(min(before(s) for s in r) for r in with_comm),
            "all-reduces": statistics.median(min(len(s["comm"]) for s in r) for r in with_comm)}


def chrome_trace(per_rank: list[dict]) -> dict:
    """The recorded steps as Chrome trace events: a process per variant, compute and comm rows per rank."""
    events = []
    origin = min(s["start"] for r in per_rank for steps in r["steps"].values() for s in steps)

    def event(name, start, end, pid, tid):
        events.append({"name": name, "ph": "X", "ts": 1e6 * (start - origin), "dur": 1e6 * (end - start),
                       "pid": pid, "tid": tid})

    for rank, r in enumerate(per_rank):
        for variant, steps in r["steps"].items():
            for s in steps:
                compute = f"rank {rank} compute"
                event("forward", s["start"], s["forward_end"], variant, compute)
                event("backward", s["forward_end"], s["last_grad"], variant, compute)
                if "first_grad" in s:  # from the first gradient landed to the last
                    event("gradients landing", s["first_grad"], s["last_grad"], variant, f"rank {rank} gradients")
                event("wait", s["last_grad"], s["backward_end"], variant, compute)
                event("optimizer", s["backward_end"], s["end"], variant, compute)
                for k, (a, b) in enumerate(s["comm"]):
                    if b is not None:
                        event(f"all-reduce {k}", a, b, variant, f"rank {rank} comm")
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def to_markdown(rows: dict, config: dict) -> str:
    cols = ["forward", "backward compute", "wait after backward", "optimizer", "step", "comm busy",
            "isolated all-reduces"]
    compiled = ""
    if config["compile"] != "none":
        split = "" if config.get("optimize_ddp", True) else ", optimize_ddp=False (one unsplit graph)"
        compiled = f", DDP(torch.compile(model, backend={config['compile']!r})){split}"
    lines = [f"{config['model']} width {config['width']} depth {config['depth']}, micro-batch {config['micro_batch']}"
             f"{compiled}, "
             f"buckets {config['cap']:g} MiB (sched: last bucket {config['last_mb']:g} MiB + optimizer in backward), "
             f"world size {config['world_size']}, gloo, 1 thread per rank; medians of {config['steps']} steps, "
             "slowest rank, ms", "", "| variant | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for variant, row in rows.items():
        lines.append(f"| {variant} | " + " | ".join(f"{row[c]:.1f}" if c in row else "" for c in cols) + " |")
    floor = rows["no_comm"]["backward compute"]
    lines += ["", "Within backward's computation (forward's end to the last gradient, = 100%):", "",
              "| variant | first gradient lands | first all-reduce starts | all-reduces started before the last "
              "gradient / all |", "|---|---:|---:|---:|"]
    for variant, row in rows.items():
        if "all-reduces" in row:
            lines.append(f"| {variant} | {row['first gradient, % of backward']:.0f}% | "
                         f"{row['first all-reduce, % of backward']:.0f}% | "
                         f"{row['all-reduces started in backward']:g} / {row['all-reduces']:g} |")
    lines.append("")
    for variant in VARIANTS[1:]:
        row = rows[variant]
        lines.append(f"- {variant}: backward's computation {row['backward compute']:.1f} ms against {floor:.1f} ms "
                     f"alone (+{row['backward compute'] - floor:.1f} ms); the all-reduces alone take "
                     f"{row['isolated all-reduces']:.1f} ms")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--world-size", type=int, default=2, help="ranks (processes on this machine)")
@click.option("--model", type=click.Choice(MODELS), default="mlp", help="the model (see dptrain bench ddp)")
@click.option("--width", type=int, default=1408, help="features per layer")
@click.option("--depth", type=int, default=8, help="layers (blocks)")
@click.option("--micro-batch", type=int, default=32, help="samples per rank per step")
@click.option("--cap", type=float, default=25.0, help="bucket size in MiB")
@click.option("--last-bucket", "last_mb", type=float, default=1.0, help="dptrain_ddp_sched's last_bucket_cap_mb")
@click.option("--steps", type=int, default=8, help="recorded steps per variant")
@click.option("--warmup", type=int, default=3, help="untimed steps per variant first")
@click.option("--compile", "backend", type=click.Choice(["none", "aot_eager", "inductor"]), default="none",
              help="train DDP(torch.compile(model, backend=...)) (aot_eager: AOTAutograd without code generation)")
@click.option("--optimize-ddp/--no-optimize-ddp", default=True,
              help="with --compile: dynamo's DDPOptimizer splits the compiled graph at bucket boundaries (torch's "
                   "default; off, the graph is one autograd node and every all-reduce starts when it is done)")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/ddp_timeline.json"),
              help="the Chrome trace to write")
def main(world_size: int, model: str, width: int, depth: int, micro_batch: int, cap: float, last_mb: float,
         steps: int, warmup: int, backend: str, optimize_ddp: bool, out: Path) -> None:
    config = dict(world_size=world_size, model=model, width=width, depth=depth, micro_batch=micro_batch, cap=cap,
                  last_mb=last_mb, steps=steps, warmup=warmup, compile=backend, optimize_ddp=optimize_ddp)
    per_rank = run_on_ranks(_rank, world_size, config, timeout=1800, threads_per_rank=1, tune_allocator=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(per_rank)))
    print(to_markdown(summarise(per_rank), config))
    print(f"\nChrome trace: {out}")


if __name__ == "__main__":
    main()
