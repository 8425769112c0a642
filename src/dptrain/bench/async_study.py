"""Study: synchronous, asynchronous and straggler-tolerant training with one worker slowed down.

Every variant is one ``dptrain run`` of the default task (the character GPT, same seed,
same number of samples: ``--steps`` synchronous steps, or the same number of gradients
in the async modes) with ``--workers`` data ranks, rank 1 slowed ``--factor`` times
(``[straggler]``), plus the server ranks for the parameter-server variants:

- ``DDP, no straggler``: the reference speed dynamic batching is measured against;
- ``DDP`` (all-reduce), ``PS sync``, ``PS async``, ``PS async, look-ahead`` (delay
  compensation, ``dptrain.ps.lookahead``), ``PS async, 2 servers`` (the parameters
  sharded over two server ranks), ``SSP s=1``, ``SSP s=4``, ``backup b=1``,
  ``dynamic batching``, ``gossip ring``: each with the straggler.

Throughput is samples per second that went into the model (a backup round's dropped
gradients do not count), the median over a run's logged windows; loss is the final
validation loss. Variants run one after another in a shuffled order per round (the
same shuffle for a given round), so slow drifts of a shared machine hit them alike;
the table shows medians over rounds, and a second table each round's speed over DDP's
in the same round.

    python -m dptrain.bench.async_study --steps 100 --rounds 2
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

import click

from dptrain.bench.results import save_result
from dptrain.bench.runs import dptrain_run, with_overrides
from dptrain.cli.bench_group import Variadic, bench_command

__all__ = ["VARIANTS", "run", "table", "main"]

PS = {"distributed.strategy": "ps", "ps.servers": 1}
ASYNC_GOAL = 1.5  # async's speed over DDP's with the straggler, in every round (issues 8 and 24)
# (name, settings, extra ranks beyond the workers, with the straggler)
VARIANTS = [
    ("DDP, no straggler", {}, 0, False),
    ("DDP", {}, 0, True),
    ("dynamic batching", {"balance.dynamic_batching": True}, 0, True),
    ("PS sync", {**PS, "ps.mode": "sync"}, 1, True),
    ("PS async", {**PS, "ps.mode": "async"}, 1, True),
    ("PS async, look-ahead", {**PS, "ps.mode": "async", "ps.lookahead": True}, 1, True),
    ("PS async, 2 servers", {**PS, "ps.mode": "async", "ps.servers": 2}, 2, True),
    ("SSP s=1", {**PS, "ps.mode": "ssp", "ps.staleness": 1}, 1, True),
    ("SSP s=4", {**PS, "ps.mode": "ssp", "ps.staleness": 4}, 1, True),
    ("backup b=1", {**PS, "ps.mode": "backup", "ps.backups": 1}, 1, True),
    ("gossip ring", {"distributed.strategy": "gossip"}, 0, True),
]


def _one(name: str, settings: dict, extra: int, slowed: bool, steps: int, workers: int, factor: float,
         directory: Path, overrides: list[str]) -> dict:
    base = {"train.steps": steps, "train.global_batch_size": 16 * workers, "log.every": max(1, steps // 20),
            "log.eval_every": 0, "log.progress": "lines", "log.plots": False, "checkpoint.every": 0,
            "log.trace_steps": 0, **settings}
    if slowed:
        base.update({"straggler.rank": 1, "straggler.factor": factor})
    done = dptrain_run(workers + extra, with_overrides(base, overrides), directory / "run")
    s = done["summary"]
    row = {"variant": name, "samples_per_s": s["median_samples_per_s"], "val_loss": s["val_loss"],
           "wall_s": done["wall_s"]}
    if "ps" in s:
        report = next(iter(s["ps"]["servers_report"].values()))
        row.update(staleness=report["staleness"], dropped=report["dropped"])
    if "stragglers" in s:
        row["stragglers"] = s["stragglers"]
    if done["train"] and "batch_shares" in done["train"][-1]:
        row["batch_shares"] = done["train"][-1]["batch_shares"]
    if done["train"] and "consensus_distance" in done["train"][-1]:
        row["consensus_distance"] = [r["consensus_distance"] for r in done["train"]]
    return row


def run(steps: int, workers: int, factor: float, rounds: int, variants: list[str] | None = None,
        overrides: list[str] | None = None) -> dict:
    chosen = [v for v in VARIANTS if variants is None or v[0] in variants]
    runs: dict[str, list[dict]] = {v[0]: [] for v in chosen}
    for r in range(rounds):
        order = list(chosen)
        random.Random(r).shuffle(order)
        for name, settings, extra, slowed in order:
            with tempfile.TemporaryDirectory() as tmp:
                row = _one(name, settings, extra, slowed, steps, workers, factor, Path(tmp), overrides or [])
            runs[name].append(row)
            print(f"round {r + 1}: {name}: {row['samples_per_s']:.1f} samples/s, val loss {row['val_loss']:.4f}",
                  flush=True)
    rows = [{"variant": name, "samples_per_s": statistics.median(x["samples_per_s"] for x in rs),
             "val_loss": statistics.median(x["val_loss"] for x in rs), "runs": rs} for name, rs in runs.items()]
    return {"steps": steps, "workers": workers, "factor": factor, "rounds": rounds, "overrides": overrides or [],
            "rows": rows}


def table(result: dict) -> str:
    by = {r["variant"]: r for r in result["rows"]}
    sync, free = by.get("DDP"), by.get("DDP, no straggler")
    lines = ["| variant | samples/s | vs DDP with the straggler | vs no straggler | final val loss | vs DDP |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        speed = f"{r['samples_per_s'] / sync['samples_per_s']:.2f}x" if sync else "-"
        recovered = f"{100 * r['samples_per_s'] / free['samples_per_s']:.0f}%" if free else "-"
        loss = f"{r['val_loss'] / sync['val_loss']:.4f}" if sync else "-"
        lines.append(f"| {r['variant']} | {r['samples_per_s']:.1f} | {speed} | {recovered} | {r['val_loss']:.4f} | "
                     f"{loss} |")
    if sync and result["rounds"] > 1:
        lines += ["", per_round(result, sync)]
    return "\n".join(lines)


def per_round(result: dict, sync: dict, goal: float = ASYNC_GOAL) -> str:
    """Each round's speed over DDP's in the same round, and in how many rounds a variant reached ``goal``."""
    rounds = result["rounds"]
    lines = ["| variant (samples/s over DDP's, same round) | " + " | ".join(f"round {i + 1}" for i in range(rounds))
             + f" | rounds >= {goal:g}x |", "|---|" + "---:|" * rounds + "---:|"]
    for r in result["rows"]:
        if r is sync:
            continue
        ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(r["runs"], sync["runs"], strict=True)]
        lines.append(f"| {r['variant']} | " + " | ".join(f"{x:.2f}" for x in ratios)
                     + f" | {sum(x >= goal for x in ratios)} of {len(ratios)} |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--steps", type=int, default=100, help="training steps per variant")
@click.option("--workers", type=int, default=2, help="worker processes per run")
@click.option("--factor", type=float, default=2.0, help="how many times slower rank 1 is")
@click.option("--rounds", type=int, default=2, help="times each variant runs, interleaved")
@click.option("--variants", cls=Variadic, type=click.Choice([v[0] for v in VARIANTS]),
              help="the variants to run (quote names with spaces); default: all")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="a dptrain run setting for every variant, e.g. gpt.n_layer=2 (repeatable)")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/async.json"),
              help="the JSON result to write")
def main(steps: int, workers: int, factor: float, rounds: int, variants: tuple[str, ...],
         overrides: tuple[str, ...], out: Path) -> None:
    result = run(steps, workers, factor, rounds, list(variants) or None, list(overrides))
    print(table(result))
    save_result(out, result)


if __name__ == "__main__":
    main()
