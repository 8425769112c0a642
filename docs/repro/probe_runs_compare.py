"""The calibration's probes run one job each against one job per round (dptrain.tune.probe_runs): same step times?

Every probe of a calibration (dptrain.tune.calibrate: the three probe models, every probe variant) is run in
rounds, alternating the two ways in ABBA order (A: one ``dptrain run`` job per probe, as calibrations did before;
B: all of a round's probes in one job), each round's probes rotated. Prints, per probe, the median of each way's
runs and their ratio (B / A), then the median ratio over the probes with a bootstrap interval, and each way's wall
time per round.

    python docs/repro/probe_runs_compare.py OUT_DIR --nproc 2 [--pairs 2]
    python docs/repro/probe_runs_compare.py OUT_DIR --cluster 2x2 --bandwidth-gbit 10     # root
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from dptrain.tune.calibrate import PROBE_MODELS, probe_variants
from dptrain.tune.machine import Emulated, Local
from dptrain.tune.probe_runs import run_probes
from dptrain.tune.trials import run_trial, write_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--cluster", help="HOSTSxPER_HOST, on the emulated cluster")
    parser.add_argument("--bandwidth-gbit", type=float, default=10.0)
    parser.add_argument("--pairs", type=int, default=2, help="ABBA pairs: 2 runs of each way per pair")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out)
    if args.cluster:
        hosts, per_host = (int(x) for x in args.cluster.split("x"))
        machine = Emulated(hosts, per_host, args.bandwidth_gbit)
    else:
        machine = Local(args.nproc)
    world = machine.world_size
    probes = []
    for i, (model, micro) in enumerate(PROBE_MODELS):
        base = write_config(out / f"probe{i}" / "model.toml", None,
                            [*model, f"train.global_batch_size={micro * world}", f"train.micro_batch_size={micro}"])
        for name, variant in probe_variants(world, machine.per_host, micro).items():
            probes.append((f"{'x'.join(o.split('=')[1] for o in model)} {name}", base, variant))
    steps: dict[str, dict[str, list[float]]] = {label: {"A": [], "B": []} for label, _, _ in probes}
    walls: dict[str, list[float]] = {"A": [], "B": []}
    order = "ABBA" * args.pairs
    with machine:
        for r, way in enumerate(order):
            rotated = probes[r % len(probes):] + probes[:r % len(probes)]
            trials = [(out / "runs" / f"{label.replace(' ', '_').replace('/', '-')}-{way}{r}", base, variant)
                      for label, base, variant in rotated]
            t0 = time.perf_counter()
            if way == "A":
                measured = [run_trial(machine, base, variant, d, args.steps, args.warmup, 600)
                            for d, base, variant in trials]
            else:
                measured = run_probes(machine, trials, args.steps, args.warmup, 600)
            walls[way].append(time.perf_counter() - t0)
            for (label, _, _), m in zip(rotated, measured, strict=True):
                steps[label][way].append(m.step_s)
            print(f"round {r} ({way}): {walls[way][-1]:.0f} s", flush=True)
    ratios = []
    print(f"{'probe':36s} {'A ms':>8s} {'B ms':>8s} {'B/A':>6s}")
    for label, ways in steps.items():
        a, b = statistics.median(ways["A"]), statistics.median(ways["B"])
        ratios.append(b / a)
        print(f"{label:36s} {a * 1e3:8.1f} {b * 1e3:8.1f} {b / a:6.3f}")
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    print(f"median B/A over {len(ratios)} probes: {statistics.median(ratios):.3f} "
          f"(95% bootstrap {boot[50]:.3f}-{boot[1949]:.3f}); range {min(ratios):.3f}-{max(ratios):.3f}")
    print(f"wall per round: one job per probe {statistics.median(walls['A']):.0f} s, "
          f"one job per round {statistics.median(walls['B']):.0f} s")
    (out / "compare.json").write_text(json.dumps({"steps": steps, "walls": walls}, indent=1))


if __name__ == "__main__":
    main()
