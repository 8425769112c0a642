"""Benchmark: DiLoCo and local SGD against synchronous DDP (torch's and dptrain's) on slow links, at equal tokens.

Two emulated hosts (``--hosts``; ``dptrain cluster``: network namespaces, each link limited by tc's
token bucket to ``--rate`` Gbit/s), one worker each, train the built-in character GPT
(the default one, or a larger one with ``--set``). One torchrun job holds every variant at
once, each its own copy of the model (the same initial weights), its own AdamW with the
run's warm-up and cosine schedule, and the same batches, and runs them **interleaved**:
each round runs ``--chunk`` steps of every variant, in an order shuffled anew each round,
so the drift of a shared machine hits all variants alike. Each variant's clock runs only
during its own steps (evaluations excluded). Variants:

- ``torch``: torch's ``DistributedDataParallel`` (25 MB buckets), the loop written out
  as dptrain's ``Engine`` runs it (global-norm clip, the same schedule);
- ``ddp``: dptrain's DDP engine through the ``Engine``;
- ``localsgd``: post-local SGD, ``--localsgd-period`` steps between averages after a
  ``--localsgd-warmup`` of DDP steps;
- ``diloco<H>``: DiLoCo with H inner steps per outer step (outer SGD, Nesterov momentum
  0.9, the learning rate by the number of replicas: 0.6 for 2); suffixes, in any order:
  ``-int8`` (or ``-bf16``, ``-int4``, ``-e3m0``) its pseudo-gradient reduced so with error
  feedback, ``-w<N>`` N synchronous warm-up steps, ``-lr<X>`` outer learning rate X,
  ``-m<X>`` outer momentum X; Streaming DiLoCo's ``-f<P>`` P fragments, ``-o<T>`` T steps
  of overlap, ``-mix<A>`` mixing A (``diloco30-f2-o1-e3m0-m0.7``).

Every ``--eval-every`` steps of a variant, and at its end, every rank evaluates
``--eval-batches`` micro-batches of the held-out split (DiLoCo's global weights; local
SGD's replicas, their losses averaged; at the end, after ``finish()``, the one model).
Reported per variant: the final validation loss (and its ratio to dptrain DDP's), the
bytes each host sent per step, measured on its link (``/proc/net/dev`` of its namespace,
every byte of the job's traffic over the variant's steps), and the wall time (its own steps'
seconds) at which its validation loss first reached the reference's final one (torch's DDP where it
ran), both as speed-ups over the reference.

Needs root (``dptrain cluster``).

    python -m dptrain.bench.diloco --rate 0.1 --steps 300
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist
from torch import nn

from dptrain.allocator import tune_cpu_allocator
from dptrain.api.engine import Engine, clip_by_global_norm
from dptrain.batching import BatchPlan
from dptrain.bench.results import save_result
from dptrain.cli.bench_group import Variadic, bench_command
from dptrain.cluster import Network, check_root, run_on_cluster
from dptrain.config import load_config
from dptrain.data.loader import ShardedLoader
from dptrain.launch.rendezvous import leave_process_groups
from dptrain.optim.build import build_optimizer
from dptrain.optim.schedule import warmup_cosine
from dptrain.runner.outputs import val_metrics, val_sums
from dptrain.tasks import build_task, collate

__all__ = ["VARIANTS", "run", "main"]

VARIANTS = ["torch", "ddp", "localsgd", "diloco10", "diloco50", "diloco100", "diloco50-int8"]


def _interface_bytes() -> int:
    """Bytes this host's network namespace has sent on its cluster link (every interface but loopback)."""
    sent = 0
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() != "lo":
            sent += int(counters.split()[8])  # transmit bytes
    return sent


class _Variant:
    """One variant's model, optimizer, batches, clock and records."""

    def __init__(self, name: str, task: Any, plan: BatchPlan, args: dict, rank: int):
        self.name, self.task, self.plan, self.args = name, task, plan, args
        torch.manual_seed(0)
        model = task.build_model()
        t = args["train"]
        self.lr_at = lambda s: warmup_cosine(s, t["lr"], t["warmup_steps"], args["steps"], t["min_lr_ratio"])
        factory = (lambda m: build_optimizer(m, "adamw", t["lr"], t["weight_decay"], tuple(t["betas"]), 0.0))
        if name == "torch":
            self.model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
            self.optimizer, self.engine = factory(self.model), None
        else:
            strategy, options = _strategy(name, args)
            self.engine = Engine(model, factory, plan, grad_clip=t["grad_clip"], lr_at=self.lr_at,
                                 strategy=strategy, options=options)
            self.model = self.engine.model
        self.batches = ShardedLoader(task.train_set, plan, rank, seed=0, collate_fn=collate(task)).micro_batches(0)
        self.step = 0
        self.seconds = 0.0
        self.sent = 0
        self.records: list[dict] = []

    def train(self, steps: int) -> None:
        dist.barrier()
        sent0, start = _interface_bytes(), time.perf_counter()
        for _ in range(steps):
            self._step()
        dist.barrier()
        self.seconds += time.perf_counter() - start
        self.sent += _interface_bytes() - sent0

    def _step(self) -> None:
        self.step += 1
        if self.engine is not None:
            for batch in self.engine.micro_steps(self.batches):
                self.engine.backward(self.task.loss(self.engine.model, batch))
            self.engine.step()
            return
        for k in range(self.plan.grad_accum_steps):  # torch DDP, as the Engine takes a step
            last = k == self.plan.grad_accum_steps - 1
            with (self.model.no_sync() if not last else _nothing()):
                (self.task.loss(self.model, next(self.batches)) / self.plan.grad_accum_steps).backward()
        clip_by_global_norm([p for p in self.model.parameters() if p.grad is not None], self.args["train"]["grad_clip"])
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step - 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def evaluate(self, last: bool = False) -> None:
        """Collective: the validation loss now (of the strategy's evaluation weights: DiLoCo's global ones; the
        replicas' own, averaged, for local SGD; at the end the strategy's one model)."""
        if last and self.engine is not None:
            self.engine.model.finish()
        with (contextlib.nullcontext(self.model.module) if self.engine is None else
              self.engine.model.evaluating()) as module:
            sums = val_sums(module, self.task, self.plan.micro_batch_size, self.args["eval_batches"],
                            dist.get_world_size(), dist.get_rank())
        keys = sorted(sums)
        totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(totals)
        loss = val_metrics(dict(zip(keys, totals.tolist(), strict=True)))["val_loss"]
        self.records.append({"step": self.step, "seconds": self.seconds, "sent_bytes": self.sent, "val_loss": loss,
                             "phase": "beyond" if self.step > self.args["steps"] else "equal"})


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _strategy(name: str, args: dict) -> tuple[str, Any]:
    """The registry's strategy and options of a variant name."""
    if name == "ddp":
        return "ddp", {"bucket_cap_mb": 25}
    if name == "localsgd":
        from dptrain.localsgd import LocalSGDOptions

        return "localsgd", LocalSGDOptions(period=args["localsgd_period"], warmup_steps=args["localsgd_warmup"],
                                           ddp={"bucket_cap_mb": 25})
    if name.startswith("diloco"):
        from dptrain.diloco import DiLoCoOptions

        period, *parts = name[len("diloco"):].split("-")
        settings = {"period": int(period), "ddp": {"bucket_cap_mb": 25}}
        for part in parts:
            if part in ("int8", "bf16", "int4", "e3m0"):
                settings["compression"] = part
            elif part.startswith("w"):
                settings["warmup_steps"] = int(part[1:])
            elif part.startswith("lr"):
                settings["outer_lr"] = float(part[2:])
            elif part.startswith("mix"):
                settings["mixing"] = float(part[3:])
            elif part.startswith("m"):
                settings["outer_momentum"] = float(part[1:])
            elif part.startswith("f"):
                settings["fragments"] = int(part[1:])
            elif part.startswith("o"):
                settings["overlap_steps"] = int(part[1:])
            else:
                raise ValueError(f"unknown part {part!r} of variant {name!r}: int8, bf16, int4, e3m0, w<warm-up "
                                 "steps>, lr<outer lr>, m<outer momentum>, f<fragments>, o<overlap steps>, "
                                 "mix<mixing>")
        return "diloco", DiLoCoOptions(**settings)
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)} (diloco<H>[-int8][-w<N>]...)")


def _worker(out: Path, args: dict) -> None:
    """One rank of the job (under torchrun): every variant, interleaved by chunks of steps; rank 0 writes the records."""
    tune_cpu_allocator()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    task = build_task(load_config(None, args["overrides"]))
    plan = BatchPlan.resolve(world, args["global_batch"], args["micro_batch"], None)
    variants = {name: _Variant(name, task, plan, args, rank) for name in args["variants"]}
    _interleave(variants, args, args["steps"])
    for v in variants.values():
        v.evaluate(last=True)
    if args["beyond"] > 1:  # the variants short of the reference's loss go on (at the schedule's last rate)
        reference = variants.get("torch") or variants.get("ddp")
        target = reference.records[-1]["val_loss"] if reference else None
        going = {n: v for n, v in variants.items() if v not in (variants.get("torch"), variants.get("ddp"))
                 and target is not None and v.records[-1]["val_loss"] > target}
        _interleave(going, args, int(args["beyond"] * args["steps"]), target)
    if rank == 0:
        params = sum(p.numel() for p in task.build_model().parameters())
        out.write_text(json.dumps({"records": {n: v.records for n, v in variants.items()}, "params": params}))
    dist.barrier()
    leave_process_groups()


def _interleave(variants: dict[str, _Variant], args: dict, until: int, target: float | None = None) -> None:
    """Train every variant to step ``until``, ``chunk`` steps at a time in a shuffled order per round, evaluating
    every ``eval_every`` steps; with a ``target``, also at ``until``, and a variant stops once its validation loss
    is at or below it. Without one, the caller evaluates at ``until`` (the end of the equal-token phase)."""
    going = dict(variants)
    round_index = 0
    while going:
        order = list(going)
        random.Random(round_index).shuffle(order)
        for name in order:
            v = going[name]
            v.train(min(args["chunk"], until - v.step))
            last = v.step == until
            if (v.step % args["eval_every"] == 0 and not last) or (last and target is not None):
                v.evaluate()
                if target is not None and v.records[-1]["val_loss"] <= target:
                    last = True
            if last:
                del going[name]
        round_index += 1


def run(rate_gbit: float, steps: int, chunk: int, eval_every: int, eval_batches: int, overrides: list[str],
        variants: list[str], global_batch: int = 32, micro_batch: int = 16, localsgd_period: int = 8,
        localsgd_warmup: int = 30, beyond: float = 1.0, hosts: int = 2, timeout: float = 7200) -> dict:
    """The study on ``hosts`` emulated hosts, one worker each; the micro-batch is 16, or the global batch's share of
    a host where that is smaller (8 at 4 hosts and a global batch of 32)."""
    check_root()
    micro_batch = min(micro_batch, global_batch // hosts)
    cfg = load_config(None, overrides)
    t = cfg.train
    args = dict(steps=steps, chunk=chunk, eval_every=eval_every, eval_batches=eval_batches, overrides=overrides,
                variants=variants, global_batch=global_batch, micro_batch=micro_batch,
                localsgd_period=localsgd_period, localsgd_warmup=localsgd_warmup, beyond=beyond,
                train={"lr": t.lr, "warmup_steps": t.warmup_steps, "min_lr_ratio": t.min_lr_ratio,
                       "weight_decay": t.weight_decay, "betas": list(t.betas), "grad_clip": t.grad_clip})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        with Network(hosts, rate_mbit=rate_gbit * 1000) as net:
            code = run_on_cluster(net, 1, ["-m", "dptrain.bench.diloco", "--worker", str(out),
                                           "--worker-args", json.dumps(args)],
                                  timeout=timeout, env={"OMP_NUM_THREADS": "1"})
        if code != 0:
            raise RuntimeError(f"the study's job on the {rate_gbit:g} Gbit/s cluster exited with {code}")
        raw = json.loads(out.read_text())
    return {"config": {**args, "rate_gbit": rate_gbit, "params": raw["params"], "hosts": hosts, "workers_per_host": 1,
                       "torch": torch.__version__, "cpus": os.cpu_count()},
            "records": raw["records"], "summary": summarize(raw["records"], steps)}


def summarize(records: dict[str, list[dict]], steps: int) -> dict[str, dict]:
    """Per variant: final loss and its ratio to the reference's, bytes sent per step, the time to the reference's
    final loss, and both times as speed-ups over the reference (torch's DDP where it ran, else dptrain's)."""
    reference = "torch" if "torch" in records else "ddp" if "ddp" in records else None
    target = records[reference][-1]["val_loss"] if reference else None
    out = {}
    for name, recs in records.items():
        final = [r for r in recs if r.get("phase", "equal") == "equal"][-1]  # at equal tokens
        reached = next((r for r in recs if target is not None and r["val_loss"] <= target), None)
        out[name] = {"final_val_loss": final["val_loss"], "loss_ratio": final["val_loss"] / target if target else None,
                     "sent_bytes_per_step": final["sent_bytes"] / steps, "seconds": final["seconds"],
                     "seconds_to_reference_loss": reached["seconds"] if reached else None,
                     "steps_to_reference_loss": reached["step"] if reached else None,
                     "last_step": recs[-1]["step"], "last_val_loss": recs[-1]["val_loss"]}
    base = out.get(reference, {})
    for row in out.values():
        row["fewer_bytes"] = base["sent_bytes_per_step"] / row["sent_bytes_per_step"] \
            if base and row["sent_bytes_per_step"] else None
        row["faster_equal_tokens"] = base["seconds"] / row["seconds"] if base and row["seconds"] else None
        row["sooner_to_reference_loss"] = base["seconds_to_reference_loss"] / row["seconds_to_reference_loss"] \
            if base and base["seconds_to_reference_loss"] and row["seconds_to_reference_loss"] else None
    return {"reference": reference, "variants": out}


def table(result: dict) -> str:
    cfg, summary = result["config"], result["summary"]
    ref = summary["reference"]
    lines = [f"{cfg['params'] / 1e6:.2f}M-parameter GPT ({' '.join(cfg['overrides']) or 'the default'}), "
             f"{cfg['steps']} steps of global batch {cfg['global_batch']} (micro {cfg['micro_batch']} x {cfg['hosts']} hosts x 1 "
             f"worker) on {cfg['rate_gbit']:g} Gbit/s links; variants interleaved {cfg['chunk']} steps at a time; "
             f"ratios against {ref}.", "",
             f"| variant | final val loss | / {ref} | MiB sent per step per host | fewer bytes | wall s | "
             f"faster (equal tokens) | steps, s to {ref}'s final loss | sooner |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def times(x):
        return f"{x:.2f}x" if x else "-"

    for name, r in summary["variants"].items():
        reach = (f"{r['steps_to_reference_loss']}, {r['seconds_to_reference_loss']:.0f}"
                 if r["seconds_to_reference_loss"] is not None else
                 f"not by step {r['last_step']} ({r['last_val_loss']:.4f})")
        ratio = f"{r['loss_ratio']:.4f}" if r["loss_ratio"] else "-"
        fewer = f"{r['fewer_bytes']:.1f}x" if r["fewer_bytes"] else "-"
        lines.append(f"| {name} | {r['final_val_loss']:.4f} | {ratio} | {r['sent_bytes_per_step'] / 2**20:.3f} | "
                     f"{fewer} | {r['seconds']:.0f} | {times(r['faster_equal_tokens'])} | {reach} | "
                     f"{times(r['sooner_to_reference_loss'])} |")
    return "\n".join(lines)


@bench_command(__doc__)
@click.option("--rate", type=float, default=0.1, help="link rate, Gbit/s")
@click.option("--steps", type=int, default=300, help="optimizer steps of every variant (equal tokens)")
@click.option("--chunk", type=int, default=10, help="steps of a variant between two switches")
@click.option("--eval-every", type=int, default=50, help="a validation loss every this many steps")
@click.option("--eval-batches", type=int, default=20, help="micro-batches per rank per evaluation")
@click.option("--set", "overrides", multiple=True, help="config overrides for the model (e.g. gpt.n_layer=6)")
@click.option("--variants", cls=Variadic, type=str, help=f"default: {' '.join(VARIANTS)}")
@click.option("--localsgd-period", type=int, default=8)
@click.option("--localsgd-warmup", type=int, default=30)
@click.option("--beyond", type=float, default=1.0,
              help="variants short of the reference's final loss at equal tokens train on, up to this many times "
                   "--steps (at the schedule's last rate), to time when they reach it")
@click.option("--hosts", type=int, default=2, show_default=True, help="emulated hosts, one worker each")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/diloco.json"))
def main(rate: float, steps: int, chunk: int, eval_every: int, eval_batches: int, overrides: tuple[str, ...],
         variants: tuple[str, ...], localsgd_period: int, localsgd_warmup: int, beyond: float, hosts: int, out: Path) -> None:
    result = run(rate, steps, chunk, eval_every, eval_batches, list(overrides), list(variants) or VARIANTS,
                 localsgd_period=localsgd_period, localsgd_warmup=localsgd_warmup, beyond=beyond, hosts=hosts)
    print(table(result))
    save_result(out, result)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # one host's process of run()'s cluster job: --worker OUT --worker-args JSON
        _worker(Path(sys.argv[2]), json.loads(sys.argv[4]))
    else:
        main()
