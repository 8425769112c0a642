"""Benchmark: step time of each gradient codec on a slow link, beside torch DDP's compression hooks.

Two emulated hosts (``dptrain cluster``: network namespaces, each link limited by tc's
token bucket to ``--rate`` Gbit/s, 1 by default), one worker each, train the built-in
character GPT. One torchrun job holds every variant at once, each its own copy of the
model (same initial weights) and optimizer, and runs them **interleaved**: every round
runs ``--steps`` steps of each variant, in an order shuffled anew each round (the same
on both ranks), so the drift of a shared machine hits all variants alike. Variants:

- ``no_comm``: the bare model, no gradient sync (the compute floor);
- ``dptrain/<codec>``: dptrain's DDP engine with :class:`~dptrain.compress.hook.CompressionHook`
  (``none`` = the engine's uncompressed fp32 all-reduce; fp16 and bf16 without error
  feedback, like torch's hook; int8, top-k 1% and PowerSGD rank 4 with it);
- ``dptrain/adamw``, ``dptrain/onebit_adam``: the engine uncompressed with AdamW, and with
  :class:`~dptrain.optim.OneBitAdam` (its warm-up is the untimed steps, so every timed step
  sends the momentum in 1 bit): the pair that shows what 1-bit Adam saves an Adam user;
- ``torch/none``, ``torch/fp16_compress_hook``, ``torch/powerSGD_hook``: torch's
  ``DistributedDataParallel``, bare and with its own hooks (PowerSGD rank 4, error
  feedback and warm start on, compressing from step 2). torch's PowerSGD hook runs on
  gloo only with a single bucket (see ``_wrap``), so that variant has one; the others
  use 25 MB buckets.

A step is zero_grad, forward, loss, backward (with the sync), SGD-with-momentum step (AdamW, 1-bit Adam),
timed after a barrier; its time is the slower rank's. Reported: each variant's median
step, its speed-up over ``dptrain/none`` and the dptrain/torch ratios for fp16 and
PowerSGD, as medians of per-round paired ratios with a bootstrap 90% interval; for
dptrain's codecs, where a step's reduction spends its time (``CompressionStats.timed``:
encoding on the caller's thread inside backward, the collectives on the progress thread,
and decoding with the codec's other arithmetic; medians per step, averaged over the
ranks). The three overlap backward and each other, so they do not add up to the step.

The default workload is communication-bound on purpose, the regime compression is
for: a 12.8M-parameter GPT (4 layers, width 512) at one 64-byte sequence per rank, so
the fp32 gradients (51 MB) take ~0.4 s on a 1 Gbit/s link against ~0.2 s of compute on
one core of this machine. (With the default ``dptrain run`` batch, compute on this CPU
hides a 1 Gbit/s all-reduce almost entirely and no codec can make a step much faster.)

Needs root (``dptrain cluster``).

    python -m dptrain.bench.compression_link --rate 1 --rounds 8
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from dptrain.allocator import tune_cpu_allocator
from dptrain.bench.results import save_result
from dptrain.bench.stats import paired_ratios
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.cluster import Network, check_root, run_on_cluster
from dptrain.compress import make_codec
from dptrain.compress.base import SPANS
from dptrain.compress.hook import CompressionHook
from dptrain.config import load_config
from dptrain.ddp import DistributedDataParallel
from dptrain.launch.rendezvous import leave_process_groups
from dptrain.tasks import build_task

__all__ = ["VARIANTS", "run", "main"]

VARIANTS = ["no_comm", "dptrain/none", "dptrain/fp16", "dptrain/bf16", "dptrain/int8", "dptrain/topk",
            "dptrain/powersgd", "dptrain/adamw", "dptrain/onebit_adam", "torch/none", "torch/fp16_compress_hook",
            "torch/powerSGD_hook"]
ADAM = {"dptrain/adamw", "dptrain/onebit_adam"}  # the engine uncompressed, with their own optimizers
PAIRS = [("dptrain/fp16", "torch/fp16_compress_hook"), ("dptrain/powersgd", "torch/powerSGD_hook"),
         ("dptrain/none", "torch/none")]
RANK, TOPK = 4, 0.01
GOAL, GOAL_VARIANTS = 2.0, ("dptrain/int8", "dptrain/powersgd", "dptrain/onebit_adam")  # over fp32 (issues 24, 40)


def _wrap(variant: str, module: nn.Module) -> tuple[nn.Module, CompressionHook | None]:
    engine, _, codec = variant.partition("/")
    if engine == "no_comm":
        return module, None
    if engine == "dptrain":
        model = DistributedDataParallel(module, bucket_cap_mb=25)
        if codec == "none" or variant in ADAM:
            return model, None
        # error feedback where the study needs it (int8, top-k, PowerSGD); fp16/bf16 without, as torch's hook
        hook = CompressionHook(make_codec(codec, topk_fraction=TOPK, powersgd_rank=RANK),
                               error_feedback=codec not in ("fp16", "bf16"))
        model.register_comm_hook(None, hook)
        return model, hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if codec == "powerSGD_hook":
        # torch's PowerSGD hook runs its next all-reduce from inside a gloo worker thread's
        # callback and waits for it there. With several buckets in flight on gloo, every worker
        # thread ends up waiting (2 threads by default: backward hangs), or, given more threads,
        # the ranks issue the nested all-reduces in different orders and gloo aborts on the size
        # mismatch (docs/repro/powersgd_gloo_deadlock.py). One bucket is how it runs on gloo.
        model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=4096)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK, start_powerSGD_iter=2,
                                            use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return model, None
    model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25)
    if codec == "fp16_compress_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return model, None


def _worker(out: Path, args: dict) -> None:
    """One rank of the job (under torchrun): every variant, interleaved; rank 0 writes the times."""
    tune_cpu_allocator()  # as dptrain run's workers do (dptrain.allocator)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cfg = load_config(None, [f"gpt.n_embd={args['n_embd']}", f"gpt.n_layer={args['n_layer']}", "gpt.n_head=8",
                             f"gpt.block_size={args['block_size']}"])
    task = build_task(cfg)
    torch.manual_seed(0)
    reference = task.build_model()
    batch = default_collate([task.train_set[rank * args["micro_batch"] + i] for i in range(args["micro_batch"])])
    models, opts, hooks = {}, {}, {}
    variants = args["variants"]
    for variant in variants:
        module = task.build_model()
        module.load_state_dict(reference.state_dict())
        models[variant], hooks[variant] = _wrap(variant, module)
        opts[variant] = _optimizer(variant, models[variant], args["warmup"])
        if variant == "dptrain/onebit_adam":
            hooks[variant] = opts[variant].compressor  # its stats: the momentum's 1-bit all-reduce

    def step(variant: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        opts[variant].zero_grad(set_to_none=True)
        task.loss(models[variant], batch).backward()
        opts[variant].step()
        return time.perf_counter() - start

    for variant in variants:  # warm-up: torch rebuilds its buckets, PowerSGD starts at step 2
        for _ in range(args["warmup"]):
            step(variant)
    sent = {}
    for variant, hook in hooks.items():
        if hook is not None:
            hook.stats.close_step()
            step(variant)
            sent[variant] = hook.stats.close_step()
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    split: dict[str, list[dict]] = {v: [] for v, hook in hooks.items() if hook is not None}
    for hook in hooks.values():
        if hook is not None:
            hook.stats.timed = True  # encode / communicate / decode seconds per step (a clock read per section)

    def timed_step(variant: str) -> float:
        seconds = step(variant)
        if hooks[variant] is not None:
            split[variant].append(hooks[variant].stats.close_step())
        return seconds

    for round_index in range(args["rounds"]):
        order = list(variants)
        random.Random(round_index).shuffle(order)
        for variant in order:
            times[variant].append([timed_step(variant) for _ in range(args["steps"])])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (times, split))
    if rank == 0:
        slowest = {v: [[max(r[v][k][i] for r, _ in every) for i in range(args["steps"])] for k in range(args["rounds"])]
                   for v in variants}
        # each kind's median seconds per step, averaged over the ranks
        spans = {v: {kind: statistics.mean(statistics.median(rec[f"{kind}_s"] for rec in s[v]) for _, s in every)
                     for kind in SPANS} for v in split}
        params = sum(p.numel() for p in reference.parameters())
        out.write_text(json.dumps({"step_times_s": slowest, "bytes": sent, "params": params, "spans_s": spans}))
    dist.barrier()
    leave_process_groups()


def _optimizer(variant: str, model: nn.Module, warmup: int) -> torch.optim.Optimizer:
    if variant == "dptrain/adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant == "dptrain/onebit_adam":
        from dptrain.optim import OneBitAdam

        # this bench times compressed steps, not convergence: it freezes v after its untimed warm-up on purpose,
        # so the warning that v had not settled by then says nothing here
        warnings.filterwarnings("ignore", message="1-bit Adam froze its second moment")
        return OneBitAdam(model.module.parameters(), model, lr=1e-3, weight_decay=0.01, freeze_step=warmup)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def run(rate_gbit: float, rounds: int, steps: int, warmup: int, n_embd: int, n_layer: int, block_size: int,
        micro_batch: int, timeout: float = 3600, variants: list[str] | None = None) -> dict:
    check_root()
    variants = [v for v in VARIANTS if v in (variants or VARIANTS) or v == "dptrain/none"]  # the baseline always
    args = dict(rounds=rounds, steps=steps, warmup=warmup, n_embd=n_embd, n_layer=n_layer, block_size=block_size,
                micro_batch=micro_batch, variants=variants)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        with Network(2, rate_mbit=rate_gbit * 1000) as net:
            code = run_on_cluster(net, 1, ["-m", "dptrain.bench.compression_link", "--worker", str(out),
                                           "--worker-args", json.dumps(args)],
                                  timeout=timeout, env={"OMP_NUM_THREADS": "1"})
        if code != 0:
            raise RuntimeError(f"the benchmark job on the {rate_gbit:g} Gbit/s cluster exited with {code}")
        raw = json.loads(out.read_text())
    times = raw["step_times_s"]
    medians = {v: statistics.median(t for rnd in per_round for t in rnd) for v, per_round in times.items()}
    speedups = {v: paired_ratios(times["dptrain/none"], times[v]) for v in variants}
    versus = {f"{a} / {b}": paired_ratios(times[a], times[b]) for a, b in PAIRS if a in times and b in times}
    if ADAM <= set(times):  # what 1-bit Adam saves an AdamW user
        speedups["onebit_adam vs adamw"] = paired_ratios(times["dptrain/adamw"], times["dptrain/onebit_adam"])
    return {"config": {**args, "rate_gbit": rate_gbit, "params": raw["params"], "hosts": 2, "workers_per_host": 1,
                       "optimizer": "SGD momentum 0.9 (dptrain/adamw: AdamW; dptrain/onebit_adam: 1-bit Adam)", "torch": torch.__version__, "cpus": os.cpu_count()},
            "median_step_s": medians, "speedup_vs_fp32": speedups, "dptrain_vs_torch": versus,
            "bytes_per_step": raw["bytes"], "spans_s": raw["spans_s"], "step_times_s": times}


def table(result: dict) -> str:
    cfg, med = result["config"], result["median_step_s"]
    lines = [f"{cfg['params'] / 1e6:.1f}M-parameter GPT ({cfg['n_layer']} layers, width {cfg['n_embd']}), "
             f"{cfg['micro_batch']} x {cfg['block_size']}-byte sequence(s) per rank, 2 hosts x 1 worker on "
             f"{cfg['rate_gbit']:g} Gbit/s links, {cfg['optimizer']}; {cfg['rounds']} rounds x "
             f"{cfg['steps']} steps per variant, interleaved.", "",
             "| variant | MiB sent per step per rank | median step (ms) | encode / communicate / decode (ms) | "
             f"speed-up vs dptrain fp32 [90% interval] | goal {GOAL:g}x |",
             "|---|---:|---:|---:|---:|---|"]
    fp32 = 4 * cfg["params"]  # a ring all-reduce at 2 ranks sends each rank's whole buffer once
    plain = {"dptrain/none": fp32, "dptrain/adamw": fp32, "torch/none": fp32, "torch/fp16_compress_hook": fp32 // 2}
    for variant in [v for v in VARIANTS if v in med]:
        b = result["bytes_per_step"].get(variant)
        sent_bytes = b["sent_bytes"] if b else plain.get(variant)
        sent = f"{sent_bytes / 2**20:.2f}" if sent_bytes is not None else "-"
        s = result["speedup_vs_fp32"][variant]
        spans = result.get("spans_s", {}).get(variant)
        split = " / ".join(f"{1e3 * spans[k]:.0f}" for k in SPANS) if spans else "-"
        goal = ("met" if s["median"] >= GOAL else "missed") if variant in GOAL_VARIANTS else ""
        lines.append(f"| {variant} | {sent} | {med[variant] * 1e3:.0f} | {split} | {s['median']:.2f}x "
                     f"[{s['ci90'][0]:.2f}, {s['ci90'][1]:.2f}] | {goal} |")
    if "onebit_adam vs adamw" in result["speedup_vs_fp32"]:
        s = result["speedup_vs_fp32"]["onebit_adam vs adamw"]
        lines += ["", f"dptrain/onebit_adam against dptrain/adamw (fp32, the same optimizer's uncompressed step): "
                      f"{s['median']:.2f}x [{s['ci90'][0]:.2f}, {s['ci90'][1]:.2f}]"]
    if result["dptrain_vs_torch"]:
        lines += ["", "| dptrain / torch, same codec (step time) | median of per-round ratios | 90% interval |",
                  "|---|---:|---:|"]
    for name, r in result["dptrain_vs_torch"].items():
        lines.append(f"| {name} | {r['median']:.3f} | {r['ci90'][0]:.3f} - {r['ci90'][1]:.3f} |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--rate", type=float, default=1.0, help="link rate, Gbit/s")
@click.option("--rounds", type=int, default=8, help="times each variant runs, interleaved")
@click.option("--steps", type=int, default=3, help="steps per variant per round")
@click.option("--warmup", type=int, default=3, help="untimed steps before the rounds")
@click.option("--n-embd", type=int, default=512, help="the GPT's width")
@click.option("--n-layer", type=int, default=4, help="the GPT's blocks")
@click.option("--block-size", type=int, default=64, help="tokens per sequence")
@click.option("--micro-batch", type=int, default=1, help="sequences per rank per step")
@click.option("--variants", cls=Variadic, type=click.Choice(VARIANTS),
              help="the variants to run (dptrain/none, the baseline, always runs); default: all")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/compression_link.json"),
              help="the JSON result to write")
def main(rate: float, rounds: int, steps: int, warmup: int, n_embd: int, n_layer: int, block_size: int,
         micro_batch: int, variants: tuple[str, ...], out: Path) -> None:
    result = run(rate, rounds, steps, warmup, n_embd, n_layer, block_size, micro_batch, variants=list(variants))
    print(table(result))
    save_result(out, result)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # one host's process of run()'s cluster job: --worker OUT --worker-args JSON
        _worker(Path(sys.argv[2]), json.loads(sys.argv[4]))
    else:
        main()
