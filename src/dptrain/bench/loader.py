"""Benchmark: how fast the token-file loader feeds one rank, against what a training step takes from it.

A token file (``--tokens`` random ids, uint16, memory-mapped) is read through the
loader ``dptrain run`` uses (:class:`~dptrain.data.loader.ShardedLoader`: the
distributed sampler, torch's DataLoader in the training process, and
:class:`~dptrain.data.tokens.TokenWindows`), with sequential and with random windows;
the built-in task's in-memory byte windows are measured beside them as the reference.
The step is the default config's GPT (``dptrain run``'s model: 4 layers, width 192,
block 64) taking a forward, backward and AdamW step on one micro-batch of the default
global batch (32) in this process, all threads.

Variants are interleaved: each round times every loader for ``--batches`` micro-batches
and the step for ``--steps`` steps, in a shuffled order. A loader's samples per second
against the step's gives the headroom: how many times faster than the step needs the
loader delivers. The loader runs in the training process (no worker processes), so its
time per micro-batch adds to the step's: 1/headroom is its share of the step.

With ``--cold`` the token file is evicted from the page cache before each loader's turn,
so windows are read from the disk (a dataset larger than memory); without it the file
is cached, as a dataset that fits in memory is after its first epoch.

    dptrain bench loader --rounds 5
    dptrain bench loader --rounds 5 --cold
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch

from dptrain.batching import BatchPlan
from dptrain.bench.results import save_result
from dptrain.cli.bench_group import bench_command
from dptrain.config import RunConfig
from dptrain.data.loader import ShardedLoader
from dptrain.data.tokens import TokenWindows
from dptrain.optim.build import build_optimizer
from dptrain.tasks import build_task
from dptrain.tasks.chargpt import ByteBlocks

__all__ = ["main"]


def _evict(dataset) -> None:
    """Drop a token file's pages from the page cache (unmapped first): the next reads come from the disk."""
    if not isinstance(dataset, TokenWindows):
        return
    dataset._data = None
    gc.collect()
    fd = os.open(dataset.path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cold_read_s(path: Path) -> float:
    """Seconds to read ``path`` sequentially after evicting it from the page cache."""
    windows = TokenWindows(path, "uint16", 1)
    _evict(windows)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return time.perf_counter() - t0


def _loader_rate(loader: ShardedLoader, start_step: int, batches: int, cold: bool) -> float:
    """Samples per second over ``batches`` micro-batches from ``start_step`` (a fresh iterator each time, as a
    resumed run starts one); ``cold``: with the file out of the page cache first."""
    if cold:
        _evict(loader.dataset)
    it = loader.micro_batches(start_step)
    next(it)  # the DataLoader's iterator is built on the first draw: counted in the run, not per batch
    t0 = time.perf_counter()
    for _ in range(batches):
        x, _y = next(it)
    return batches * x.shape[0] / (time.perf_counter() - t0)


def _step_rate(task, model: torch.nn.Module, opt: torch.optim.Optimizer, batch, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()
        opt.step()
    return steps * batch[0].shape[0] / (time.perf_counter() - t0)


@bench_command(__doc__)
@click.option("--rounds", type=int, default=5, help="interleaved rounds of every loader and the training step")
@click.option("--batches", type=int, default=200, help="micro-batches per loader per round")
@click.option("--steps", type=int, default=5, help="training steps per round")
@click.option("--tokens", type=float, default=50e6, help="tokens in the file (uint16: 2 bytes each)")
@click.option("--cold", is_flag=True, help="evict the token file from the page cache before each "
              "loader's turn (posix_fadvise DONTNEED): reads from the disk, as a file larger than memory")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/loader.json"),
              help="the JSON result to write")
def main(rounds: int, batches: int, steps: int, tokens: float, cold: bool, out: Path) -> None:
    cfg = RunConfig()
    g, t = cfg.gpt, cfg.train
    plan = BatchPlan.resolve(1, t.global_batch_size or 32, t.micro_batch_size, t.grad_accum_steps)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-loader-") as tmp:
        path = Path(tmp) / "train.bin"
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:  # written in chunks: the file may be larger than one wants in memory
            left = int(tokens)
            while left:
                n = min(left, 1 << 24)
                rng.integers(0, 256, n, dtype=np.uint16).tofile(f)
                left -= n
        loaders = {
            "token file, sequential": ShardedLoader(TokenWindows(path, "uint16", g.block_size), plan, rank=0),
            "token file, random": ShardedLoader(TokenWindows(path, "uint16", g.block_size, "random"), plan, rank=0),
            "built-in (bytes in memory)": ShardedLoader(
                ByteBlocks(torch.randint(0, 256, (g.corpus_bytes,)), g.block_size), plan, rank=0),
        }
        task = build_task(cfg)  # the default run's model and loss
        model = task.build_model()
        opt = build_optimizer(model, t.optimizer, t.lr, t.weight_decay, tuple(t.betas), t.momentum)
        batch = next(loaders["token file, sequential"].micro_batches(0))
        _step_rate(task, model, opt, batch, 2)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in [*loaders, "training step"]}
        order = random.Random(0)
        for r in range(rounds):
            names = list(rates)
            order.shuffle(names)
            for name in names:
                if name == "training step":
                    rates[name].append(_step_rate(task, model, opt, batch, steps))
                else:  # a different place in the file each round: no window is read twice
                    start = r * (batches + 1) // plan.grad_accum_steps
                    rates[name].append(_loader_rate(loaders[name], start, batches, cold))
        file_mb = path.stat().st_size / 2**20
        disk = _cold_read_s(path) if cold else None

    step = statistics.median(rates["training step"])
    print(f"default GPT ({sum(p.numel() for p in model.parameters()):,} parameters, block {g.block_size}), "
          f"micro-batch {plan.micro_batch_size}, {torch.get_num_threads()} threads; token file {tokens:,.0f} "
          f"tokens ({file_mb:,.0f} MiB, uint16, {'evicted from' if cold else 'in'} the page cache); {rounds} interleaved rounds of {batches} micro-batches per "
          f"loader and {steps} steps\n")
    print("| what | samples/s, median | per round | x what a step consumes | share of a step |")
    print("|---|---:|---|---:|---:|")
    for name, values in rates.items():
        median = statistics.median(values)
        each = ", ".join(f"{v:,.0f}" for v in values)
        if name == "training step":
            print(f"| {name} | {median:,.0f} | {each} | 1 | |")
        else:
            print(f"| loader: {name} | {median:,.0f} | {each} | {median / step:,.0f}x | {100 * step / median:.2f}% |")
    if disk is not None:
        print(f"the whole file read once from out of the page cache: {disk:.3f} s ({file_mb / disk:,.0f} MiB/s): "
              "this disk's speed, which the cold figures assume")
    worst = min(statistics.median(v) for k, v in rates.items() if k.startswith("token file")) / step
    print(f"\ngoal: the token-file loader at least 20x faster than the step needs: {worst:,.0f}x "
          f"({'met' if worst >= 20 else 'missed'})")
    save_result(out, {"rates_samples_per_s": rates, "micro_batch": plan.micro_batch_size,
                        "block_size": g.block_size, "tokens": tokens, "threads": torch.get_num_threads(),
                        "cold": cold, "cold_read_s": disk, "headroom_worst": worst})


if __name__ == "__main__":
    main()
