"""Benchmark: what glibc's malloc defaults cost a CPU training step, and what tuning saves.

Runs the plain (no data parallelism) model of ``dptrain.bench.ddp`` in fresh processes,
alternating glibc's default malloc settings with :func:`dptrain.allocator.tune_cpu_allocator`,
and reports step time and minor page faults per step for each. The setting is
process-wide, so the comparison alternates processes rather than steps.

    python -m dptrain.bench.allocator --trials 4
"""

from __future__ import annotations

import resource
import statistics
import time

import click
import torch

from dptrain.bench.ddp_models import build_model
from dptrain.cli.bench_group import bench_command
from dptrain.testing import run_on_ranks


def _steps(rank: int, world_size: int, width: int, depth: int, micro_batch: int, steps: int) -> tuple[float, float]:
    model = build_model(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(micro_batch, width)
    times, faults = [], []
    for step in range(steps + 3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if step >= 3:  # warm-up: the first steps fault in memory under any setting
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(times), statistics.median(faults)


@bench_command(__doc__)
@click.option("--trials", type=int, default=4, help="processes per setting, alternating")
@click.option("--steps", type=int, default=12, help="timed steps per process (the median is reported)")
@click.option("--width", type=int, default=1408, help="MLP width (features per Linear)")
@click.option("--depth", type=int, default=8, help="Linear layers in the MLP")
@click.option("--micro-batch", type=int, default=32, help="samples per step")
def main(trials: int, steps: int, width: int, depth: int, micro_batch: int) -> None:
    results: dict[str, list[tuple[float, float]]] = {"glibc default": [], "tune_cpu_allocator()": []}
    for _ in range(trials):
        for name, tuned in (("glibc default", False), ("tune_cpu_allocator()", True)):
            results[name].append(run_on_ranks(_steps, 1, width, depth, micro_batch, steps,
                                              tune_allocator=tuned, timeout=1800)[0])
    print(f"plain {depth} x Linear({width}) MLP, batch {micro_batch}, 1 thread, "
          f"{trials} alternating processes per setting, median of {steps} steps each\n")
    print("| malloc | step (ms), median over processes | minor page faults per step, median | "
          "each process: step ms / faults |")
    print("|---|---:|---:|---|")
    for name, rows in results.items():
        each = ", ".join(f"{t * 1e3:.0f} / {f:,.0f}" for t, f in rows)
        print(f"| {name} | {statistics.median(r[0] for r in rows) * 1e3:.1f} "
              f"| {statistics.median(r[1] for r in rows):,.0f} | {each} |")


if __name__ == "__main__":
    main()
