"""Benchmark: ``dptrain plan``'s memory against what ``dptrain run``'s engine actually holds.

For each strategy and precision, fresh worker processes train the default task (the
character GPT of ``dptrain run``, its default config: 32 sequences of 64 bytes per
step over the world size) through :class:`dptrain.api.engine.Engine` for a few steps,
and each rank measures:

- *model states*: parameters, gradients and optimizer state between the last backward
  and its optimizer step (when both exist; the engine frees ``.grad`` after a step), counted from
  live tensors (the ZeRO engine's :func:`~dptrain.zero.memory.state_bytes`; for the DDP
  engine every parameter, gradient, bucket buffer and optimizer tensor);
- *peak*: the process's peak **anonymous** memory during a step, over what it held
  before the model was built: VmHWM (reset per step through ``/proc/self/clear_refs``)
  minus the file-backed pages resident at the end of the step (RssFile: the libraries'
  code, which a first backward and a first optimizer step page in; no plan of tensors
  can or should predict it), minus the anonymous memory before the build. Allocations of 64 KiB or more get their own
  ``mmap``, so resident memory follows the live tensors. The first step is reported
  apart (it creates the optimizer state at its end); the peak is the largest over the
  later steps, for the larger rank.

Beside each measurement: the plan of ``dptrain plan`` for the same config (rank 0).

    python -m dptrain.bench.plan --world-size 2
    python -m dptrain.bench.plan --world-size 4 --strategies zero3 --shard-size 2   # hybrid sharding
"""

from __future__ import annotations

from pathlib import Path

import click
import torch

from dptrain.api.engine import Engine
from dptrain.batching import BatchPlan
from dptrain.bench.results import save_result
from dptrain.bench.zero import allocator_follows_tensors
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.config import load_config
from dptrain.optim.build import build_optimizer
from dptrain.planner.from_config import plan_config
from dptrain.strategies import get_strategy, strategy_names
from dptrain.tasks import build_task
from dptrain.testing import run_on_ranks
from dptrain.zero.memory import state_bytes, storage_bytes

__all__ = ["run", "main"]

_MiB = 2**20


def _status(*fields: str) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in fields:
                out[name] = int(line.split()[1]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _overrides(strategy: str, precision: str, shard_size: int) -> list[str]:
    hybrid = [f"zero.shard_size={shard_size}"] if shard_size and get_strategy(strategy).shards_parameters else []
    return [f"distributed.strategy={strategy}", f"train.precision={precision}", *hybrid]


def _rank(rank: int, world_size: int, strategy: str, precision: str, shard_size: int, steps: int) -> dict:
    allocator_follows_tensors()
    cfg = load_config(None, _overrides(strategy, precision, shard_size))
    task = build_task(cfg)
    plan = BatchPlan.resolve(world_size, 32)
    before = _status("RssAnon")["RssAnon"]
    torch.manual_seed(0)
    model = task.build_model()
    t = cfg.train
    engine = Engine(model, lambda m: build_optimizer(m, t.optimizer, t.lr, t.weight_decay, tuple(t.betas),
                                                     t.momentum),
                    plan, precision=precision, grad_clip=t.grad_clip, strategy=strategy,
                    ddp_kwargs=dict(bucket_cap_mb=cfg.ddp.bucket_cap_mb,
                                    gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view),
                    zero_kwargs=get_strategy(strategy).options(cfg, model, 1)
                    if get_strategy(strategy).shards_parameters else None)
    del model
    batches = engine.loader(task.train_set).micro_batches()
    peaks = []
    for step in range(steps):
        _reset_peak()
        for batch in engine.micro_steps(batches):
            with engine.autocast():
                loss = task.loss(engine.model, batch)
            engine.backward(loss)
        del loss
        if step == steps - 1:  # gradients and optimizer state both exist: between backward and the step
            states = _model_states(engine)
        engine.step()
        status = _status("VmHWM", "RssFile")
        peaks.append({"anon": status["VmHWM"] - status["RssFile"] - before, "hwm": status["VmHWM"]})
    return {"states": states, "first_step_peak": peaks[0]["anon"], "peak": max(p["anon"] for p in peaks[1:]),
            "micro_batch": plan.micro_batch_size}


def _model_states(engine: Engine) -> dict[str, int]:
    if engine.sharded:
        return state_bytes(engine.model, engine.optimizer)
    seen: set = set()
    params = list(engine.model.module.parameters())
    grads = [p.grad for p in params] + [b.buffer for b in engine.model.reducer.buckets]
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": storage_bytes(params, seen), "gradients": storage_bytes(grads, seen),
            "optimizer": storage_bytes(state, seen)}


def run(world_size: int, strategies: list[str], precisions: list[str], steps: int, shard_size: int = 0) -> dict:
    rows = []
    for precision in precisions:
        for strategy in strategies:
            overrides = _overrides(strategy, precision, shard_size)
            planned = plan_config(load_config(None, overrides), [world_size], [strategy], [precision])[0]
            per_rank = run_on_ranks(_rank, world_size, strategy, precision, shard_size, steps, timeout=900,
                                    tune_allocator=False)
            measured_states = per_rank[0]["states"]
            hybrid = shard_size and get_strategy(strategy).shards_parameters
            rows.append({
                "strategy": strategy + (f", shard_size {shard_size}" if hybrid else ""),
                "precision": precision, "world_size": world_size,
                "micro_batch": per_rank[0]["micro_batch"],
                "planned_model_states": planned.states.total, "measured_model_states_rank0": sum(
                    measured_states.values()),
                "planned_total": planned.total(), "planned_activations": planned.activations.saved,
                "planned_comm_buffers": planned.comm_buffers,
                "measured_peak": max(r["peak"] for r in per_rank),
                "measured_peak_per_rank": [r["peak"] for r in per_rank],
                "measured_first_step_peak": max(r["first_step_peak"] for r in per_rank),
            })
    return {"rows": rows, "torch": torch.__version__}


def table(result: dict) -> str:
    lines = ["| strategy | precision | N | micro-batch | model states: planned / measured | planned total "
             "(activations, comm buffers) | measured peak | measured / planned |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['precision']} | {r['world_size']} | {r['micro_batch']} | "
            f"{r['planned_model_states'] / _MiB:.2f} / {r['measured_model_states_rank0'] / _MiB:.2f} | "
            f"{r['planned_total'] / _MiB:.1f} ({r['planned_activations'] / _MiB:.1f}, "
            f"{r['planned_comm_buffers'] / _MiB:.1f}) | {r['measured_peak'] / _MiB:.1f} | "
            f"{r['measured_peak'] / r['planned_total']:.3f} |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--world-size", type=int, default=2, help="ranks (processes on this machine)")
@click.option("--strategies", cls=Variadic, type=click.Choice(strategy_names(lambda s: s.planned)),
              default=strategy_names(lambda s: s.planned), help="the strategies to plan and measure")
@click.option("--precisions", cls=Variadic, type=click.Choice(["fp32", "bf16"]), default=("fp32", "bf16"),
              help="the precisions to plan and measure")
@click.option("--steps", type=int, default=4, help="steps per measurement (the first reported apart)")
@click.option("--shard-size", type=int, default=0,
              help="hybrid sharding: ZeRO strategies shard over groups of this many ranks (zero.shard_size)")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/plan.json"),
              help="the JSON result to write")
def main(world_size: int, strategies: tuple[str, ...], precisions: tuple[str, ...], steps: int, shard_size: int,
         out: Path) -> None:
    if steps < 2:
        raise click.UsageError(f"--steps must be at least 2 (the first step is reported apart), got {steps}")
    result = run(world_size, list(strategies), list(precisions), steps, shard_size)
    print(table(result))
    save_result(out, result)


if __name__ == "__main__":
    main()
