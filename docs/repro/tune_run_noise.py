"""How far apart two runs of one configuration are, in their step and in their compute alone (docs/tune.md).

    python docs/repro/tune_run_noise.py EXHAUSTIVE_DIR ...

A search runs each configuration in several rounds (``trials/NN-label-rK``). Each run's ``metrics.jsonl`` holds,
per step, its wall time (``step_ms``) and the slowest rank's forward, backward and optimizer spans (``compute_ms``):
the part of the step the simulator takes from the compute profile, not from the links or the fitted overheads. For
each configuration: the runs' medians after the first 4 steps, and (max - min) / mean of each. Where the compute
alone moves by more than 10% between runs of one configuration, no prediction of its step can be within 10% of both.
The runs are also listed in the order they ran, the compute as a share of its configuration's mean, so that a slow
stretch of minutes (the machine, not the configuration) shows as neighbours.
"""

import json
import statistics
import sys
from pathlib import Path

WARMUP = 4


def runs(search: Path) -> list[dict]:
    out = []
    for d in sorted((search / "trials").glob("*-r[0-9]*")):
        lines = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [s for s in lines if s.get("kind") == "train"][WARMUP:]
        if not steps:
            continue
        out.append({"config": d.name.split("-", 1)[1].rsplit("-r", 1)[0], "start": steps[0]["time"],
                    "step": statistics.median(s["step_ms"] for s in steps),
                    "compute": statistics.median(s["compute_ms"] for s in steps)})
    return out


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.mean(values)


def main(argv: list[str]) -> None:
    for search in map(Path, argv):
        rs = runs(search)
        if not rs:
            raise SystemExit(f"{search}: no trials/*/run/metrics.jsonl (bench_results keep them since tune25)")
        configs = sorted({r["config"] for r in rs})
        by = {c: [r for r in rs if r["config"] == c] for c in configs}
        print(f"{search.parent.name}/{search.name}: {len(rs)} runs of {len(configs)} configurations")
        print(f"  {'configuration':28s} {'steps (ms)':>18s} {'spread':>7s} {'compute (ms)':>18s} {'spread':>7s}")
        step_spreads, compute_spreads = [], []
        for c in configs:
            s, k = [r["step"] for r in by[c]], [r["compute"] for r in by[c]]
            step_spreads.append(spread(s))
            compute_spreads.append(spread(k))
            print(f"  {c:28s} {' '.join(f'{v:5.0f}' for v in s):>18s} {100 * step_spreads[-1]:6.1f}% "
                  f"{' '.join(f'{v:5.0f}' for v in k):>18s} {100 * compute_spreads[-1]:6.1f}%")
        print(f"  step spread: median {100 * statistics.median(step_spreads):.1f}%, max {100 * max(step_spreads):.1f}%, "
              f"over 10% in {sum(x > 0.1 for x in step_spreads)} of {len(configs)}")
        print(f"  compute spread: median {100 * statistics.median(compute_spreads):.1f}%, "
              f"max {100 * max(compute_spreads):.1f}%, over 10% in {sum(x > 0.1 for x in compute_spreads)} of {len(configs)}")
        mean = {c: statistics.mean(r["compute"] for r in by[c]) for c in configs}
        t0 = min(r["start"] for r in rs)
        print("  in the order run (minutes from the first; compute / its configuration's mean):")
        for r in sorted(rs, key=lambda r: r["start"]):
            share = r["compute"] / mean[r["config"]]
            print(f"    {(r['start'] - t0) / 60:5.1f}  {r['config']:28s} {share:5.2f} {'#' * max(0, round(40 * (share - 0.8)))}")


if __name__ == "__main__":
    main(sys.argv[1:])
