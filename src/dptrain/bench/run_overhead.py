"""Benchmark: what ``dptrain run``'s instrumentation costs a training step.

Two Engines train the same model (the default ``chargpt`` GPT, 1.84M parameters) on the
same ranks, interleaved: each round runs a few steps of each variant, in an order
shuffled anew each round (the same on every rank). Variants:

- ``bare``: ``engine.micro_steps`` / ``backward`` / ``step``, nothing else;
- ``bare_control``: the same as ``bare`` on a third Engine built after the other two: the
  A/A control. Its ratio to ``bare`` shows how much two identical Engines differ in one
  process (memory placement, construction order), the resolution of this measurement;
- ``instrumented``: the step as ``dptrain run`` takes it (``loop.timed_step``: wall-clock
  spans around forward, backward and the optimizer), with exact per-bucket completion
  times (``record_spans``: a callback on each all-reduce's future), every step added to
  the Chrome trace, and a metrics record (one ``all_gather``) every ``--log-every`` steps.

A step's time is the slowest rank's, after a barrier. The report gives each variant's
median and the instrumented/bare ratio per round: the median of those paired ratios
with a bootstrap 90% interval. Timings mean something only side by side within a run.

    python -m dptrain.bench.run_overhead --rounds 12
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist

from dptrain.api.engine import Engine
from dptrain.batching import BatchPlan
from dptrain.bench.stats import paired_ratios
from dptrain.cli.bench_group import bench_command
from dptrain.config import load_config
from dptrain.runner.loop import timed_step
from dptrain.runner.metrics import StepRecorder
from dptrain.runner.trace import TraceRecorder
from dptrain.tasks import build_task
from dptrain.testing import run_on_ranks

VARIANTS = ("bare", "instrumented", "bare_control")


def _bare_step(engine: Engine, task, batches) -> None:
    for batch in engine.micro_steps(batches):
        with engine.autocast():
            loss = task.loss(engine.model, batch)
        engine.backward(loss)
    engine.step()


def _bench_rank(rank: int, world_size: int, args: dict) -> dict:
    cfg = load_config(None, [f"gpt.corpus_bytes={args['corpus_bytes']}"])
    task = build_task(cfg)
    plan = BatchPlan.resolve(world_size, global_batch_size=args["global_batch"])
    engines, streams = {}, {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = task.build_model()
        engines[variant] = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan, grad_clip=1.0)
        streams[variant] = engines[variant].loader(task.train_set, seed=0).micro_batches()
    engines["instrumented"].model.record_comm_spans(True)
    recorder = StepRecorder(engines["instrumented"].device, plan.global_batch_size, task.tokens_per_sample)
    tracer = TraceRecorder(rank, time.perf_counter(), 1, 10**9)
    for variant in VARIANTS:
        for _ in range(args["warmup"]):
            _bare_step(engines[variant], task, streams[variant])
    times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    count = 0
    for round_index in range(args["rounds"]):
        order = list(VARIANTS)
        random.Random(round_index).shuffle(order)
        for variant in order:
            times[variant].append([])
            engine, batches = engines[variant], streams[variant]
            for _ in range(args["steps"]):
                dist.barrier()
                start = time.perf_counter()
                if variant != "instrumented":
                    _bare_step(engine, task, batches)
                else:
                    count += 1
                    info, step_times = timed_step(engine, task, batches)
                    recorder.add(step_times)
                    tracer.add_step(count, step_times)
                    if count % args["log_every"] == 0:
                        recorder.record(count, info.loss, info.lr, info.grad_norm, 0)
                times[variant][-1].append(time.perf_counter() - start)
    return {"times": times}


def run(world_size: int, rounds: int, steps: int, warmup: int, log_every: int, global_batch: int,
        corpus_bytes: int) -> dict:
    args = dict(rounds=rounds, steps=steps, warmup=warmup, log_every=log_every, global_batch=global_batch,
                corpus_bytes=corpus_bytes)
    per_rank = run_on_ranks(_bench_rank, world_size, args, timeout=7200,
                            threads_per_rank=max(1, (os.cpu_count() or 1) // world_size))
    step_times = {v: [[max(r["times"][v][k][i] for r in per_rank) for i in range(steps)] for k in range(rounds)]
                  for v in VARIANTS}
    return {
        "config": dict(world_size=world_size, rounds=rounds, steps_per_round=steps, log_every=log_every,
                       global_batch=global_batch, torch=torch.__version__, cpus=os.cpu_count()),
        "median_step_ms": {v: 1e3 * statistics.median(t for rnd in step_times[v] for t in rnd) for v in VARIANTS},
        "instrumented_over_bare": paired_ratios(step_times["instrumented"], step_times["bare"]),
        "control_over_bare": paired_ratios(step_times["bare_control"], step_times["bare"]),
        "step_times_s": step_times,
    }


@bench_command(__doc__)
@click.option("--world-size", type=int, default=2, help="ranks (processes on this machine)")
@click.option("--rounds", type=int, default=12, help="rounds; each runs every variant in a shuffled order")
@click.option("--steps", type=int, default=5, help="steps per variant per round")
@click.option("--warmup", type=int, default=3, help="untimed steps per variant before the rounds")
@click.option("--log-every", type=int, default=10, help="metrics record (all_gather) every N steps")
@click.option("--global-batch", type=int, default=32, help="samples per step over all ranks")
@click.option("--corpus-bytes", type=int, default=500_000, help="bytes of the chargpt training text")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/run_overhead.json"),
              help="the JSON result (raw step times) to write")
def main(world_size: int, rounds: int, steps: int, warmup: int, log_every: int, global_batch: int,
         corpus_bytes: int, out: Path) -> None:
    result = run(world_size, rounds, steps, warmup, log_every, global_batch, corpus_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    med = result["median_step_ms"]
    print(f"{world_size} ranks, default chargpt GPT, global batch {global_batch}, {rounds} rounds x "
          f"{steps} steps per variant")
    print(f"median step: bare {med['bare']:.1f} ms, instrumented {med['instrumented']:.1f} ms, "
          f"bare_control {med['bare_control']:.1f} ms")
    for name, key in (("instrumented / bare", "instrumented_over_bare"), ("bare_control / bare (A/A)",
                                                                          "control_over_bare")):
        ratio = result[key]
        print(f"{name}, paired per round: median {ratio['median']:.3f}, "
              f"90% interval [{ratio['ci90'][0]:.3f}, {ratio['ci90'][1]:.3f}]")
    print(f"raw step times: {out}")


if __name__ == "__main__":
    main()
