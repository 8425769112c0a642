"""Benchmark: every collective algorithm over a sweep of message sizes, against the cost model.

One run, everything interleaved: each repetition runs every (size, collective, algorithm)
cell once in an order shuffled anew (the same on every rank), so a slow phase of a
shared machine hits all of them alike. A measurement is the slowest rank's time for
``iters`` back-to-back calls after a barrier, divided by ``iters`` (many iterations for
small messages, where one call is shorter than the barrier's skew across ranks).

Reported, with nccl-tests' definitions: time, algbw = bytes / time, busbw = algbw x
(2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and all-gather, 1 for broadcast).

The cost model gets one (α, β, γ) for the machine, fitted to all measurements of
dptrain's algorithms at once: if the model's rounds and bytes are right, one link
explains every algorithm, collective and size, and the table prints each prediction
beside the measurement. As a cross-check, a second link is fitted to a different
measurement, a point-to-point exchange with the ring neighbours (the round every
algorithm is made of) and a local add. Each algorithm's own effective (α, β) is fitted
too, and all of it goes to JSON for the planner.

    dptrain bench comm --world-size 2            # or: python -m dptrain.bench.comm
    dptrain bench comm --world-size 4 --max-size 1M --collectives all_reduce
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.bench.stats import bootstrap_ci
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.comm.cost import Link, busbw_factor, collective_cost
from dptrain.comm.fit import fit_gamma, fit_link
from dptrain.comm.wire import Wire
from dptrain.testing import run_on_ranks

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
ITEMSIZE = 4  # float32


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def iterations(nbytes: int) -> int:
    """Calls per measurement: enough that one measurement moves about 4 MiB (at most 50)."""
    return max(1, min(50, (4 << 20) // max(nbytes, 1)))


# --------------------------------------------------------------------- on each rank


def _timed(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _call(collective: str, algorithm: str, x: torch.Tensor, out: torch.Tensor, nodes, validate: bool) -> None:
    kw = dict(algorithm=algorithm, nodes=nodes, validate=validate)
    if collective == "all_reduce":
        comm.all_reduce(x, **kw)
    elif collective == "reduce_scatter":
        comm.reduce_scatter(out, x, **kw)
    elif collective == "all_gather":
        comm.all_gather(x, out, **kw)
    else:
        comm.broadcast(x, 0, **kw)


def _exchange_times(rank: int, world_size: int, sizes: list[int], reps: int) -> dict[int, list[float]]:
    """One point-to-point round with the ring neighbours: send right, receive from the left."""
    wire, times = Wire(None), {s: [] for s in sizes}
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for _ in range(reps):
        for size in sizes:
            a, b = torch.ones(size // ITEMSIZE), torch.zeros(size // ITEMSIZE)  # touched: no page faults timed
            times[size].append(_timed(lambda a=a, b=b: wire.exchange([(right, a)], [(left, b)]), iterations(size)))
    return times


def _add_times(sizes: list[int], reps: int) -> dict[int, list[float]]:
    times = {s: [] for s in sizes}
    for _ in range(reps):
        for size in sizes:
            a, b = torch.ones(size // ITEMSIZE), torch.ones(size // ITEMSIZE)
            iters = iterations(size)
            start = time.perf_counter()
            for _ in range(iters):
                a.add_(b)
            times[size].append((time.perf_counter() - start) / iters)
    return times


def _sweep(rank: int, world_size: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    nodes = cfg["nodes"]
    out = {"exchange": _exchange_times(rank, world_size, cfg["sizes"], cfg["reps_small"]),
           "add": _add_times(cfg["sizes"], cfg["reps_small"]), "times": {}}
    cells = [(c, alg) for c in cfg["collectives"] for alg in cfg["algorithms"]]
    buffers = {}
    for size in cfg["sizes"]:
        numel = size // ITEMSIZE
        a, b = comm.shard_range(numel, world_size, rank)
        buffers[size] = x, shard = torch.ones(numel), torch.ones(b - a)
        for collective, algorithm in cells:  # warm-up, and the one call that checks agreement
            _call(collective, algorithm, x, shard, nodes, validate=True)
    # Sizes are interleaved too: a slow phase of the machine spreads over all sizes
    # instead of bending the curve at one of them.
    reps = {size: cfg["reps_large"] if size >= (4 << 20) else cfg["reps_small"] for size in cfg["sizes"]}
    for rep in range(max(reps.values())):
        order = [(size, cell) for size in cfg["sizes"] if rep < reps[size] for cell in cells]
        random.Random(f"rep {rep}").shuffle(order)  # the same order on every rank
        for size, (collective, algorithm) in order:
            x, shard = buffers[size]
            x.fill_(1.0)
            dt = _timed(lambda c=collective, a=algorithm, x=x, s=shard: _call(c, a, x, s, nodes, False), iterations(size))
            out["times"].setdefault(f"{collective}|{algorithm}|{size}", []).append(dt)
    # The slowest rank's time, measurement by measurement.
    keys = sorted(out["times"])
    flat = torch.tensor([t for k in keys for t in out["times"][k]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    i = 0
    for k in keys:
        n = len(out["times"][k])
        out["times"][k] = flat[i:i + n].tolist()
        i += n
    return out


# --------------------------------------------------------------------- analysis


def run(world_size: int, sizes: list[int], algorithms: list[str], collectives: list[str], nodes,
        reps_small: int, reps_large: int) -> dict:
    cfg = dict(sizes=sizes, algorithms=algorithms, collectives=collectives, nodes=nodes,
               reps_small=reps_small, reps_large=reps_large)
    per_rank = run_on_ranks(_sweep, world_size, cfg, timeout=7200)
    exchange = {s: statistics.median(max(r["exchange"][s][i] for r in per_rank) for i in range(reps_small))
                for s in sizes}
    add = {s: statistics.median(per_rank[0]["add"][s]) for s in sizes}
    rows, times = [], per_rank[0]["times"]
    for key, samples in times.items():
        collective, algorithm, size = key.split("|")
        size = int(size)
        cost = collective_cost(collective, algorithm, size // ITEMSIZE, ITEMSIZE, world_size, nodes=nodes)
        median = statistics.median(samples)
        algbw = size / median
        rows.append(dict(collective=collective, algorithm=algorithm, bytes=size, median_s=median,
                         samples_s=samples, algbw_GBps=algbw / 1e9,
                         busbw_GBps=algbw * busbw_factor(collective, world_size) / 1e9, rounds=cost.steps(),
                         critical_bytes=cost.load(duplex=True), critical_bytes_half_duplex=cost.load(duplex=False),
                         reduced_bytes=sum(r.reduced for r in cost.rounds), cost=cost))
    ours = [r for r in rows if r["algorithm"] != "native"]
    fits = {duplex: _fit(ours, duplex) for duplex in (True, False)}
    link = min(fits.values(), key=lambda fit: _median_error(ours, fit))
    # The cross-check link: one exchange round with the ring neighbours (each rank sends
    # and receives ``size``, a load of 2 x size on a half-duplex link), and a local add.
    p2p = fit_link([1] * len(sizes), [s if link.duplex else 2 * s for s in sizes], [exchange[s] for s in sizes])
    p2p = Link(p2p.alpha, p2p.beta, gamma=fit_gamma(sizes, [add[s] for s in sizes]), duplex=link.duplex)
    for r in rows:
        cost = r.pop("cost")
        r["predicted_s"], r["predicted_p2p_s"] = cost.predict(link), cost.predict(p2p)
        r["predicted_other_duplex_s"] = cost.predict(fits[not link.duplex])
    return {
        "config": dict(world_size=world_size, nodes=nodes, dtype="float32", backend="gloo",
                       reps_small=reps_small, reps_large=reps_large, torch=torch.__version__,
                       cpus=os.cpu_count(), machine=platform.machine()),
        "link": dict(_link_json(link),
                     fitted_from="every measurement of dptrain's algorithms (one alpha, beta, gamma for all); "
                                 "duplex or half duplex, whichever has the smaller median relative error"),
        "link_other_duplex": dict(_link_json(fits[not link.duplex]), fitted_from="the same, the other duplex mode"),
        "link_p2p": dict(_link_json(p2p),
                         fitted_from="point-to-point exchange with ring neighbours (alpha, beta); local add (gamma)"),
        "exchange_s": exchange,
        "per_algorithm_fit": _per_algorithm_fit(rows, link.duplex),
        "ring_vs_native": _paired(times, "ring", "native", [s for s in sizes if s >= (16 << 20)]),
        "tree_vs_ring": _paired(times, "tree", "ring", [s for s in sizes if s <= (64 << 10)]),
        "rows": rows,
    }


def _fit(rows: list[dict], duplex: bool) -> Link:
    key = "critical_bytes" if duplex else "critical_bytes_half_duplex"
    link = fit_link([r["rounds"] for r in rows], [r[key] for r in rows], [r["median_s"] for r in rows],
                    [r["reduced_bytes"] for r in rows])
    return Link(link.alpha, link.beta, link.gamma, duplex)


def _median_error(rows: list[dict], link: Link) -> float:
    return statistics.median(abs(r["cost"].predict(link) / r["median_s"] - 1) for r in rows)


def _link_json(link: Link) -> dict:
    return dict(alpha_s=link.alpha, beta_Bps=link.beta, gamma_s_per_B=link.gamma, duplex=link.duplex)


def _per_algorithm_fit(rows: list[dict], duplex: bool) -> dict:
    fits, load = {}, "critical_bytes" if duplex else "critical_bytes_half_duplex"
    for key in sorted({(r["collective"], r["algorithm"]) for r in rows}):
        mine = [r for r in rows if (r["collective"], r["algorithm"]) == key and r["rounds"]]
        if len({r["bytes"] for r in mine}) >= 2:
            link = fit_link([r["rounds"] for r in mine], [r[load] for r in mine],
                            [r["median_s"] for r in mine])
            fits["|".join(key)] = dict(alpha_s=link.alpha, beta_Bps=link.beta)
    return fits


def _paired(times: dict, ours: str, theirs: str, sizes: list[int]) -> dict:
    """Per size, per repetition ratio ours/theirs (interleaved in the same repetition)."""
    out = {}
    for key in times:
        collective, algorithm, size = key.split("|")
        other = f"{collective}|{theirs}|{size}"
        if algorithm == ours and int(size) in sizes and other in times:
            paired = [a / b for a, b in zip(times[key], times[other], strict=True)]
            out[f"{collective}|{size}"] = dict(median=statistics.median(paired), ci90=bootstrap_ci(paired),
                                               per_rep=paired)
    return out


def to_markdown(result: dict) -> str:
    cfg, link = result["config"], result["link"]
    rows = result["rows"]
    present = {r["algorithm"] for r in rows}
    algorithms = [a for a in comm.ALGORITHMS if a in present]
    p2p = result["link_p2p"]
    mode = "full-duplex" if link.get("duplex", True) else "half-duplex"
    lines = [f"World size {cfg['world_size']}, gloo, float32, nodes={cfg['nodes']}, torch {cfg['torch']}, "
             f"{cfg['cpus']} CPUs. One {mode} link fitted to all of dptrain's measurements: α = "
             f"{link['alpha_s'] * 1e6:.0f} µs, β = {link['beta_Bps'] / 1e9:.2f} GB/s, γ = "
             f"{link['gamma_s_per_B'] * 1e12:.0f} ps/B. Fitted to a point-to-point exchange and a local add "
             f"instead: α = {p2p['alpha_s'] * 1e6:.0f} µs, β = {p2p['beta_Bps'] / 1e9:.2f} GB/s, "
             f"γ = {p2p['gamma_s_per_B'] * 1e12:.0f} ps/B."]
    for collective in [c for c in COLLECTIVES if any(r["collective"] == c for r in rows)]:
        lines += ["", f"**{collective}**: measured ms (model ms) and busbw GB/s", "",
                  "| size | " + " | ".join(algorithms) + " |", "|---|" + "---:|" * len(algorithms)]
        for size in sorted({r["bytes"] for r in rows}):
            cells = []
            for algorithm in algorithms:
                r = next((r for r in rows if (r["collective"], r["algorithm"], r["bytes"]) ==
                          (collective, algorithm, size)), None)
                cells.append("" if r is None else f"{r['median_s'] * 1e3:.3g} ({r['predicted_s'] * 1e3:.3g}) "
                             f"{r['busbw_GBps']:.2f}")
            lines.append(f"| {human(size)} | " + " | ".join(cells) + " |")
    for title, key in (("ring / native (same repetition)", "ring_vs_native"),
                       ("tree / ring (same repetition)", "tree_vs_ring")):
        if result[key]:
            lines += ["", f"| {title} | median | 90% interval |", "|---|---:|---:|"]
            for name, r in sorted(result[key].items(),
                                  key=lambda kv: (COLLECTIVES.index(kv[0].split("|")[0]), int(kv[0].split("|")[1]))):
                collective, size = name.split("|")
                lines.append(f"| {collective} {human(int(size))} | {r['median']:.3f} | "
                             f"{r['ci90'][0]:.3f} - {r['ci90'][1]:.3f} |")
    big = [r for r in rows if r["bytes"] >= (1 << 20) and r["algorithm"] != "native"]
    if big:
        other = "half-duplex" if mode == "full-duplex" else "full-duplex"
        lines.append("")
        for label, key in ((f"the fitted {mode} link", "predicted_s"),
                           (f"a {other} link fitted the same way", "predicted_other_duplex_s"),
                           (f"the {mode} link from the point-to-point exchange", "predicted_p2p_s")):
            if key not in big[0]:
                continue
            errors = [abs(r[key] / r["median_s"] - 1) for r in big]
            within = sum(e <= 0.25 for e in errors)
            lines.append(f"Model ({label}) vs measured at >= 1 MiB, dptrain's algorithms: median |error| "
                         f"{statistics.median(errors):.0%}, worst {max(errors):.0%}, {within} of {len(errors)} "
                         "cells within 25%.")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--world-size", type=int, default=2, help="ranks (processes on this machine, gloo)")
@click.option("--min-size", default="4K", help="smallest message, bytes (K, M, G suffixes)")
@click.option("--max-size", default="64M", help="largest message; sizes grow 4x from --min-size")
@click.option("--algorithms", cls=Variadic, help="default: native ring tree naive, and hierarchical with --nodes")
@click.option("--collectives", cls=Variadic, type=click.Choice(COLLECTIVES), default=COLLECTIVES,
              help="the collectives to time")
@click.option("--nodes", type=int, default=None, help="ranks per node for the hierarchical algorithm")
@click.option("--reps", type=int, default=12, help="repetitions per size below 4 MiB")
@click.option("--reps-large", type=int, default=6, help="repetitions per size from 4 MiB")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="default bench_results/comm_ws<N>.json")
@click.option("--report", type=click.Path(path_type=Path), default=None,
              help="print the tables of a saved result and exit")
def main(world_size: int, min_size: str, max_size: str, algorithms: tuple[str, ...], collectives: tuple[str, ...],
         nodes: int | None, reps: int, reps_large: int, out: Path | None, report: Path | None) -> None:
    if report:
        print(to_markdown(json.loads(report.read_text())))
        return
    sizes, size = [], parse_size(min_size)
    while size <= parse_size(max_size):
        sizes.append(size)
        size *= 4
    algorithms = list(algorithms) or ["native", "ring", "tree", "naive"] + (["hierarchical"] if nodes else [])
    for algorithm in algorithms:
        comm.check_algorithm(algorithm, nodes, world_size)
    result = run(world_size, sizes, algorithms, list(collectives), nodes, reps, reps_large)
    out = out or Path(f"bench_results/comm_ws{world_size}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(to_markdown(result))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
