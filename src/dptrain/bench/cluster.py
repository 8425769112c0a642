"""Benchmark: ``dptrain simulate``'s step time against real two-host runs on the emulated cluster.

For each link rate and DDP bucket size, ``dptrain run`` (the default character GPT,
micro-batch 16 per rank, the DDP engine) runs on ``dptrain cluster``: 2 hosts x 1
worker, each host's link limited by tc's token bucket. The measured step time is the
median of the run's ``step_ms`` (``metrics.jsonl``) after ``--warmup`` steps.

The prediction uses the same model, batch and bucket size:

- compute: :func:`~dptrain.planner.simulate.measure_profile` on the real model, run
  in 2 processes at once, one thread each (what the two workers share: this machine's
  2 cores), without communication; the median over the two;
- network: the link the job actually gets, fitted: before the runs at each rate,
  :mod:`dptrain.tune.link_probe` times gloo all-reduces of 64 KiB to 32 MiB between
  the two hosts and α, β are fitted to them with the cost model's rounds and bytes
  (``dptrain.comm.fit.fit_link``); the nominal tbf rate is reported beside the fit;
- then :func:`~dptrain.planner.simulate.simulate_step`, bucket by bucket.

Timings on this machine drift by up to 2-3x between minutes, so a compute profile
measured apart from a run can be far from that run's compute. The main prediction
therefore takes the run's own compute time (the engine's forward, backward and
optimizer spans, ``compute_ms``, median) and the profile only for its proportions and
for when each gradient is ready: it tests the communication and overlap model, which
is what the network changes. The prediction from the profile alone is reported beside.

Needs root (``dptrain cluster``).

    python -m dptrain.bench.cluster --rates 1 5 --buckets 1 4 25
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch
from torch.utils.data import default_collate

from dptrain.bench.results import save_result
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.cluster import Network, check_root, run_on_cluster
from dptrain.comm.cost import Link
from dptrain.config import load_config
from dptrain.planner.from_config import optimizer_for, setup_for
from dptrain.planner.network import Network as Links
from dptrain.planner.simulate import ComputeProfile, measure_profile, simulate_step
from dptrain.tasks import build_task
from dptrain.testing import run_on_ranks
from dptrain.tune.calibrate import fit_probe

__all__ = ["run", "main", "profile_together", "rescaled_profile", "fit_cluster_link",
           "measure_on_cluster"]

MICRO = 16


def _profile_rank(rank: int, world_size: int, micro: int) -> ComputeProfile:
    cfg = load_config(None, [])
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    batch = default_collate([task.train_set[i + rank * micro] for i in range(micro)])
    return measure_profile(model, batch, task.loss, optimizer_for(cfg, list(model.parameters())), steps=8)


def profile_together(ranks: int, micro: int) -> ComputeProfile:
    """The default model's compute profile at ``micro`` samples, timed in ``ranks`` processes at once
    (1 thread each, no communication: what the workers of a cluster job share), averaged."""
    profiles = run_on_ranks(_profile_rank, ranks, micro, timeout=600, threads_per_rank=1)
    return ComputeProfile(statistics.mean(p.forward_s for p in profiles),
                          statistics.mean(p.backward_s for p in profiles),
                          statistics.mean(p.optimizer_s for p in profiles),
                          {k: statistics.mean(p.ready[k] for p in profiles) for k in profiles[0].ready},
                          f"measured: {ranks} processes at once, 1 thread each, no communication")


def rescaled_profile(profile: ComputeProfile, total_s: float) -> ComputeProfile:
    """``profile`` with forward, backward and optimizer scaled to add up to ``total_s`` (ready fractions kept)."""
    k = total_s / (profile.forward_s + profile.backward_s + profile.optimizer_s)
    return ComputeProfile(profile.forward_s * k, profile.backward_s * k, profile.optimizer_s * k, profile.ready,
                          profile.source + f", rescaled to the run's own compute ({total_s * 1e3:.0f} ms)")


def fit_cluster_link(rate_gbit: float, per_host: int = 1, within_hosts: bool = False,
                     kinds: tuple[str, ...] = ("all_reduce",)) -> Link:
    """α and β of an emulated link at ``rate_gbit``, fitted to timed gloo collectives (``kinds``) on 2 hosts.

    Across the hosts (over all ``per_host`` ranks of both, one each by default), or
    ``within_hosts``: inside each host's ``per_host`` ranks, both hosts at once.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        with Network(2, rate_mbit=rate_gbit * 1000) as net:
            code = run_on_cluster(net, per_host, ["-m", "dptrain.tune.link_probe", str(out)]
                                  + (["--within-hosts"] if within_hosts else []), timeout=600,
                                  env={"OMP_NUM_THREADS": "1"})
        if code != 0:
            raise RuntimeError(f"the link probe at {rate_gbit} Gbit/s exited with {code}")
        return fit_probe(json.loads(out.read_text()), kinds)


def measure_on_cluster(rate_gbit: float, per_host: int, overrides: list[str], steps: int, warmup: int) -> dict:
    """``dptrain run`` (the default task, ``overrides``) on 2 hosts x ``per_host``: the medians of its
    step, compute and exposed-communication times (``metrics.jsonl``) after ``warmup`` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        args = ["-m", "dptrain.run", "--set", f"train.steps={steps}", "--set", "checkpoint.every=0",
                "--set", "log.every=1", "--set", "log.eval_every=0", "--set", "log.plots=false",
                *[a for o in overrides for a in ("--set", o)], "--run-dir", str(run_dir)]
        with Network(2, rate_mbit=rate_gbit * 1000) as net:
            code = run_on_cluster(net, per_host, args, timeout=900, env={"OMP_NUM_THREADS": "1"})
        if code != 0:
            raise RuntimeError(f"the cluster run at {rate_gbit} Gbit/s with {' '.join(overrides)} exited with {code}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train" and r["step"] > warmup]
    return {"step_ms": statistics.median(r["step_ms"] for r in train),
            "compute_ms": statistics.median(r["compute_ms"] for r in train),
            "exposed_comm_ms": statistics.median(r["exposed_comm_ms"] for r in train),
            "steps": len(train)}


def run(rates: list[float], buckets: list[float], steps: int, warmup: int) -> dict:
    check_root()
    profile = profile_together(2, MICRO)
    cfg = load_config(None, [])
    model = build_task(cfg).build_model()
    rows, fits = [], {}
    for rate in rates:
        link = fit_cluster_link(rate)
        fits[rate] = {"alpha_s": link.alpha, "beta_Bps": link.beta, "nominal_Bps": rate * 1e9 / 8}
        print(f"{rate:g} Gbit/s: fitted alpha {link.alpha * 1e3:.2f} ms, beta {link.beta * 8 / 1e9:.2f} Gbit/s",
              flush=True)
        links = Links(f"{rate:g}Gbit", link, link, 1, f"tbf {rate:g} Gbit/s, fitted")
        for bucket in buckets:
            setup = setup_for(load_config(None, [f"ddp.bucket_cap_mb={bucket}"]), model, "ddp", 2, "fp32")
            t0 = time.perf_counter()
            measured = measure_on_cluster(rate, 1, ["train.global_batch_size=32", f"ddp.bucket_cap_mb={bucket}"],
                                          steps, warmup)
            own = rescaled_profile(profile, measured["compute_ms"] / 1e3)
            predicted = simulate_step(model, setup, own, links)
            apart = simulate_step(model, setup, profile, links)
            rows.append({"rate_gbit": rate, "bucket_mb": bucket, "predicted_step_ms": predicted.step_s * 1e3,
                         "predicted_exposed_ms": predicted.exposed_s * 1e3, "predicted_comm_ms": predicted.comm_s * 1e3,
                         "predicted_step_ms_profile_apart": apart.step_s * 1e3,
                         "measured": measured, "wall_s": time.perf_counter() - t0})
            print(_line(rows[-1]), flush=True)
    return {"profile": {"forward_ms": profile.forward_s * 1e3, "backward_ms": profile.backward_s * 1e3,
                        "optimizer_ms": profile.optimizer_s * 1e3, "source": profile.source},
            "links": fits, "rows": rows, "torch": torch.__version__}


def _line(r: dict) -> str:
    m = r["measured"]
    return (f"| {r['rate_gbit']:g} | {r['bucket_mb']:g} | {m['compute_ms']:.0f} | {r['predicted_step_ms']:.0f} "
            f"({r['predicted_exposed_ms']:.0f}) | {m['step_ms']:.0f} ({m['exposed_comm_ms']:.0f}) | "
            f"{r['predicted_step_ms'] / m['step_ms']:.2f} | {r['predicted_step_ms_profile_apart']:.0f} |")


def table(result: dict) -> str:
    head = ("| link (Gbit/s) | bucket (MB) | run's compute, ms | predicted step (exposed), ms | "
            "measured step (exposed), ms | predicted / measured | from the profile alone, ms |\n"
            "|---:|---:|---:|---:|---:|---:|---:|")
    return head + "\n" + "\n".join(_line(r) for r in result["rows"])


@bench_command(__doc__)
@click.option("--rates", cls=Variadic, type=float, default=(1.0, 5.0), help="link rates, Gbit/s")
@click.option("--buckets", cls=Variadic, type=float, default=(1.0, 4.0, 25.0), help="DDP bucket caps, MB")
@click.option("--steps", type=int, default=16, help="steps per run (the first --warmup not timed)")
@click.option("--warmup", type=int, default=4, help="untimed steps at the start of each run")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/cluster.json"),
              help="the JSON result to write")
def main(rates: tuple[float, ...], buckets: tuple[float, ...], steps: int, warmup: int, out: Path) -> None:
    if steps <= warmup:
        raise click.UsageError(f"--steps ({steps}) must exceed --warmup ({warmup})")
    result = run(list(rates), list(buckets), steps, warmup)
    p = result["profile"]
    print(f"compute profile: forward {p['forward_ms']:.1f} ms, backward {p['backward_ms']:.1f} ms, optimizer "
          f"{p['optimizer_ms']:.1f} ms ({p['source']})")
    for rate, fit in result["links"].items():
        print(f"link {rate:g} Gbit/s (tbf): fitted alpha {fit['alpha_s'] * 1e3:.2f} ms, beta "
              f"{fit['beta_Bps'] * 8 / 1e9:.2f} Gbit/s")
    print(table(result))
    save_result(out, result)


if __name__ == "__main__":
    main()
