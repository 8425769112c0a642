"""Benchmark: DDP, ZeRO-3 and hybrid sharding on 2 emulated hosts x 2 ranks, beside ``dptrain simulate``.

``dptrain run`` (the default character GPT, ``--micro`` samples per rank) runs on
``dptrain cluster``: 2 hosts x 2 workers, each host's link limited to ``--rate`` Gbit/s
by tc's token bucket, the two ranks inside a host joined by the host's loopback
(unlimited). Three variants, interleaved round by round (the order rotates):

- ``ddp``: the DDP engine, one all-reduce of the gradients over the 4 ranks;
- ``zero3``: ZeRO-3 over the 4 ranks: every gather and reduce-scatter crosses hosts;
- ``hsdp``: ZeRO-3 sharded over each host's 2 ranks (``zero.shard_size=2``), each
  reduced shard all-reduced with the other host's.

A variant's step time is the median of the run's ``step_ms`` after ``--warmup`` steps;
the HSDP / ZeRO-3 ratio is taken per round (paired), then its median.

The predictions use :func:`~dptrain.planner.simulate.simulate_step` on the same model
and batch, with a network fitted on this cluster (``dptrain.tune.link_probe``, α and β
fitted to all-reduces and all-gathers of 64 KiB to 32 MiB together): across hosts from
the 4 ranks' collectives, which every ring step takes across the host link, and inside
a host from its 2 ranks' collectives, both hosts at once. The replicate all-reduces of
hybrid sharding (2 ranks, one per host, both pairs at once on the hosts' shared links,
``shared_net``) are predicted from these fits, not fitted. Two predictions per variant:

- *from the profile alone*: compute from ``measure_profile`` in 4 processes at once
  (what the 4 workers share: this machine's 2 cores), one thread each;
- *with the run's compute*: the profile's proportions rescaled to the compute time the
  DDP engine measured in the same round (its forward, backward and optimizer spans;
  ZeRO's engine reports no such split, its compute span includes its waits). This
  isolates the communication model from this machine's drifting speed.

Needs root (``dptrain cluster``).

    python -m dptrain.bench.cluster_zero --rate 1 --rounds 3
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import torch

from dptrain.bench.cluster import fit_cluster_link, measure_on_cluster, profile_together, rescaled_profile
from dptrain.bench.results import save_result
from dptrain.bench.stats import paired_ratios
from dptrain.cli.bench_group import bench_command
from dptrain.cluster import check_root
from dptrain.config import load_config
from dptrain.planner.from_config import setup_for
from dptrain.planner.network import Network
from dptrain.planner.simulate import simulate_step
from dptrain.tasks import build_task

__all__ = ["VARIANTS", "run", "table", "main"]

HOSTS, PER_HOST = 2, 2
VARIANTS = {"ddp": ['distributed.strategy="ddp"'], "zero3": ['distributed.strategy="zero3"'],
            "hsdp": ['distributed.strategy="zero3"', f"zero.shard_size={PER_HOST}"]}


def run(rate_gbit: float, rounds: int, steps: int, warmup: int, micro: int) -> dict:
    check_root()
    world = HOSTS * PER_HOST
    profile = profile_together(world, micro)
    both = ("all_reduce", "all_gather")
    across = fit_cluster_link(rate_gbit, per_host=PER_HOST, kinds=both)
    inside = fit_cluster_link(rate_gbit, per_host=PER_HOST, within_hosts=True, kinds=both)
    network = Network(f"{HOSTS}x{PER_HOST}", inside, across, PER_HOST, f"tbf {rate_gbit:g} Gbit/s per host, fitted",
                      shared_net=True, backend="gloo")
    print(f"links: across hosts alpha {across.alpha * 1e3:.2f} ms, beta {across.beta * 8 / 1e9:.2f} Gbit/s; "
          f"inside a host alpha {inside.alpha * 1e3:.2f} ms, beta {inside.beta * 8 / 1e9:.2f} Gbit/s", flush=True)
    model = build_task(load_config(None, [])).build_model()
    setups = {v: setup_for(load_config(None, o), model, "ddp" if v == "ddp" else "zero3", world, "fp32")
              for v, o in VARIANTS.items()}
    measured: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    t0 = time.perf_counter()
    for r in range(rounds):
        for v in names[r % len(names):] + names[:r % len(names)]:
            m = measure_on_cluster(rate_gbit, PER_HOST, [f"train.global_batch_size={world * micro}", *VARIANTS[v]],
                                   steps, warmup)
            measured[v].append(m)
            print(f"round {r}: {v} step {m['step_ms']:.0f} ms (compute {m['compute_ms']:.0f})", flush=True)
    rows = []
    for v in VARIANTS:
        own = [simulate_step(model, setups[v], rescaled_profile(profile, d["compute_ms"] / 1e3), network, "native").step_s
               for d in measured["ddp"]]  # round by round, with that round's DDP compute
        rows.append({"variant": v, "measured_step_ms": statistics.median(m["step_ms"] for m in measured[v]),
                     "measured_per_round_ms": [m["step_ms"] for m in measured[v]],
                     "predicted_step_ms": statistics.median(own) * 1e3,
                     "predicted_step_ms_profile_apart": simulate_step(model, setups[v], profile, network,
                                                                      "native").step_s * 1e3})
    hsdp_over_zero3 = paired_ratios([[m["step_ms"]] for m in measured["hsdp"]],
                                    [[m["step_ms"]] for m in measured["zero3"]])
    return {"rate_gbit": rate_gbit, "micro_batch": micro, "steps": steps, "warmup": warmup, "rounds": rounds,
            "profile": {"forward_ms": profile.forward_s * 1e3, "backward_ms": profile.backward_s * 1e3,
                        "optimizer_ms": profile.optimizer_s * 1e3, "source": profile.source},
            "links": {"across": {"alpha_s": across.alpha, "beta_Bps": across.beta},
                      "inside": {"alpha_s": inside.alpha, "beta_Bps": inside.beta}},
            "ddp_compute_ms": [m["compute_ms"] for m in measured["ddp"]],
            "rows": rows, "hsdp_over_zero3": hsdp_over_zero3, "wall_s": time.perf_counter() - t0,
            "torch": torch.__version__}


def table(result: dict) -> str:
    lines = ["| variant | measured step, ms (per round) | predicted with the run's compute, ms (/ measured) | "
             "predicted from the profile alone, ms (/ measured) |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        m = r["measured_step_ms"]
        rounds = ", ".join(f"{x:.0f}" for x in r["measured_per_round_ms"])
        lines.append(f"| {r['variant']} | {m:.0f} ({rounds}) | {r['predicted_step_ms']:.0f} "
                     f"({r['predicted_step_ms'] / m:.2f}) | {r['predicted_step_ms_profile_apart']:.0f} "
                     f"({r['predicted_step_ms_profile_apart'] / m:.2f}) |")
    ratio = result["hsdp_over_zero3"]
    lines.append(f"\nHSDP / ZeRO-3 step time: {ratio['median']:.2f} (per round: "
                 f"{', '.join(f'{x:.2f}' for x in ratio['per_round'])})")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--rate", type=float, default=1.0, help="each host's link rate, Gbit/s")
@click.option("--rounds", type=int, default=3, help="times each variant runs, interleaved")
@click.option("--steps", type=int, default=14, help="steps per run (the first --warmup not timed)")
@click.option("--warmup", type=int, default=4, help="untimed steps at the start of each run")
@click.option("--micro", type=int, default=1, help="samples per rank per step")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/cluster_zero.json"),
              help="the JSON result to write")
def main(rate: float, rounds: int, steps: int, warmup: int, micro: int, out: Path) -> None:
    if steps <= warmup:
        raise click.UsageError(f"--steps ({steps}) must exceed --warmup ({warmup})")
    if rounds < 1 or micro < 1:
        raise click.UsageError(f"--rounds and --micro must be positive, got {rounds} and {micro}")
    result = run(rate, rounds, steps, warmup, micro)
    p = result["profile"]
    print(f"compute profile: forward {p['forward_ms']:.1f} ms, backward {p['backward_ms']:.1f} ms, optimizer "
          f"{p['optimizer_ms']:.1f} ms ({p['source']}); DDP's measured compute per round: "
          f"{', '.join(f'{x:.0f}' for x in result['ddp_compute_ms'])} ms")
    print(table(result))
    save_result(out, result)


if __name__ == "__main__":
    main()
