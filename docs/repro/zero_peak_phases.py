"""Where a ZeRO step's peak memory goes, and when its reductions start (the figures in docs/benchmarks.md).

For each variant of ``dptrain bench zero`` (same GPT, same per-tensor-mmap allocator
setting, 2 gloo ranks), rank 0 prints its resident memory (MiB over the level before
the model was built) at the end of each phase of a step: the peak during the phase,
then the level at its end. For the dptrain variants it also prints when each unit's
reduce-scatter was launched, as a fraction of backward's wall time, beside the moments
each transformer block's backward finished. ``--sync-reductions`` makes every
reduction finish before backward continues (no overlap), as FSDP2's do on CPU.

    python docs/repro/zero_peak_phases.py dptrain_zero3 torch_fsdp2
    python docs/repro/zero_peak_phases.py dptrain_zero3 --sync-reductions

Against an older commit, with this script from the current one:

    git worktree add /tmp/old a36c979 && PYTHONPATH=/tmp/old/src python docs/repro/zero_peak_phases.py dptrain_zero2
"""

from __future__ import annotations

import argparse
import time

import torch

from dptrain.bench import zero as bench
from dptrain.testing import run_on_ranks
from dptrain.zero.unit import FlatUnit

ARGS = dict(n_layer=6, n_embd=320, n_head=5, block_size=32, micro_batch=2, device="cpu", lr=1e-4)


def _rank(rank: int, world_size: int, variant: str, sync: bool) -> dict:
    bench._allocator_follows_tensors()
    device = torch.device("cpu")
    x, y = bench._batch(rank, ARGS, device)
    meter = bench._ProcessMemory(device)
    before = meter.now()
    model, opt = bench.wrap(variant, bench.build_model(ARGS).to(device), ARGS["lr"], device)
    events: list[tuple[float, str]] = []
    if variant.startswith("dptrain"):
        def timed(original):
            def wrapper(self, *args):
                events.append((time.perf_counter(), f"reduce unit {self.index}"))
                original(self, *args)
                if sync:
                    self.reduction.settle_oldest()
            return wrapper

        for name in ("_launch", "reduce_accumulated"):  # the latter is absent from older commits
            if hasattr(FlatUnit, name):
                setattr(FlatUnit, name, timed(getattr(FlatUnit, name)))
        for block in model.module.blocks:
            block.register_full_backward_hook(lambda *_: events.append((time.perf_counter(), "block backward")))
    phases = []
    for _ in range(3):
        events.clear()
        phases.clear()
        meter.reset_peak()
        for name in ("zero_grad", "forward", "backward", "step"):
            if name == "zero_grad":
                opt.zero_grad(set_to_none=True)
            elif name == "forward":
                logits = model(x)
            elif name == "backward":
                t0 = time.perf_counter()
                torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
                t1 = time.perf_counter()
            else:
                opt.step()
            phases.append((name, (meter.peak() - before) / 2**20, (meter.now() - before) / 2**20))
            meter.reset_peak()
    return {"phases": phases, "events": [(round((t - t0) / (t1 - t0), 2), what) for t, what in events]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", choices=bench.VARIANTS)
    parser.add_argument("--sync-reductions", action="store_true")
    a = parser.parse_args()
    for variant in a.variants:
        got = run_on_ranks(_rank, 2, variant, a.sync_reductions, timeout=600, tune_allocator=False)[0]
        print(f"{variant}{' (synchronous reductions)' if a.sync_reductions else ''}, rank 0, MiB peak / end:")
        print("  " + ", ".join(f"{name} {peak:.1f} / {end:.1f}" for name, peak, end in got["phases"]))
        if got["events"]:
            print("  backward timeline: " + ", ".join(f"{at:.2f} {what}" for at, what in got["events"]))


if __name__ == "__main__":
    main()
