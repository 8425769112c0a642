"""Time the run's model on every rank of a job at once, without communication; rank 0 writes the profiles.

Started by ``dptrain tune`` as a job on the ranks that will train, so each rank's compute
is timed while the others compute beside it, as in training (on a CPU host, a host's
ranks share its cores; a GPU host's ranks each have their own device). For each
micro-batch size, :func:`~dptrain.planner.simulate.measure_profile` times forward,
backward and the optimizer step of the config's model (median of its steps) and when
each gradient is ready; the job's profile is the mean over the ranks, written by rank 0
as JSON. The ranks meet only through barriers (one per micro-batch size, so they time
the same size together). With ``--probe OUT CONFIG MICRO_BATCHES`` (repeatable) one job
profiles several models, one after the other, each into its own file (a calibration profiles
its probe models and the tuned model in its own job, after the links:
:mod:`dptrain.tune.calibration_job`).

    torchrun ... -m dptrain.tune.compute_probe OUT.json --config RUN.toml --micro-batches 16,8,4
    torchrun ... -m dptrain.tune.compute_probe --probe A.json A.toml 4 --probe B.json B.toml 12
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

from dptrain.config import load_config
from dptrain.launch.rendezvous import leave_process_groups
from dptrain.planner.from_config import optimizer_for
from dptrain.planner.simulate import ComputeProfile, measure_profile
from dptrain.tasks import build_task, collate
from dptrain.utils.collector import freeze_imports
from dptrain.utils.worker_exit import exit_worker

__all__ = ["main", "parse_probes", "add_probe_arguments", "probes_from", "profile_model", "profile_to_dict",
           "profile_from_dict"]


def profile_to_dict(p: ComputeProfile) -> dict:
    return {"forward_s": p.forward_s, "backward_s": p.backward_s, "optimizer_s": p.optimizer_s, "ready": p.ready,
            "source": p.source}


def profile_from_dict(d: dict) -> ComputeProfile:
    return ComputeProfile(float(d["forward_s"]), float(d["backward_s"]), float(d["optimizer_s"]),
                          {str(k): float(v) for k, v in d["ready"].items()}, str(d["source"]))


def main(argv: list[str] | None = None) -> None:
    probes, steps = parse_probes(argv)
    dist.init_process_group("gloo")
    for out, config, micro_batches in probes:
        profile_model(out, config, micro_batches, steps)
    leave_process_groups()


def parse_probes(argv: list[str] | None) -> tuple[list[tuple[str, str, list[int]]], int]:
    """The command line's models to profile, in order, as (output, config, micro-batch sizes), and the steps each
    size is timed for; a usage error (exit 2) for an incomplete or empty request."""
    parser = argparse.ArgumentParser(prog="python -m dptrain.tune.compute_probe")
    parser.add_argument("out", nargs="?", help="where rank 0 writes the profiles of --config's model")
    parser.add_argument("--config")
    parser.add_argument("--micro-batches")
    add_probe_arguments(parser)
    args = parser.parse_args(argv)
    legacy = (args.out, args.config, args.micro_batches)
    if any(x is not None for x in legacy) and any(x is None for x in legacy):
        parser.error("OUT, --config and --micro-batches go together")
    return probes_from(args, parser, [legacy] if args.out is not None else []), args.steps


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """``--probe OUT CONFIG MICRO_BATCHES`` (repeatable) and ``--steps``, for a job that profiles models."""
    parser.add_argument("--probe", nargs=3, action="append", default=[], metavar=("OUT", "CONFIG", "MICRO_BATCHES"),
                        help="one model more: where its profiles go, its config, its micro-batch sizes (N,N,...)")
    parser.add_argument("--steps", type=int, default=6)


def probes_from(args: argparse.Namespace, parser: argparse.ArgumentParser,
                first: list[tuple[str, str, str]]) -> list[tuple[str, str, list[int]]]:
    """``first`` then every ``--probe`` as (output, config, micro-batch sizes); a usage error (exit 2) where there is
    none or a size is not an integer."""
    probes = [*first, *(tuple(p) for p in args.probe)]
    if not probes:
        parser.error("nothing to profile: give OUT --config FILE --micro-batches N,..., or --probe OUT CONFIG N,...")
    try:
        return [(out, config, [int(x) for x in micro.split(",")]) for out, config, micro in probes]
    except ValueError:
        parser.error(f"micro-batch sizes are integers separated by commas, got {[m for *_, m in probes]}")


def profile_model(out_path: str, config: str, micro_batches: list[int], steps: int) -> None:
    """Profile ``config``'s model at each micro-batch size on every rank; rank 0 writes the ranks' mean."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(config)
    task = build_task(cfg)
    torch.manual_seed(cfg.train.seed)
    model = task.build_model()
    opt = optimizer_for(cfg, [p for p in model.parameters() if p.requires_grad])
    profiles: dict[int, ComputeProfile] = {}
    for m in micro_batches:
        samples = collate(task)([task.train_set[(rank * m + i) % len(task.train_set)] for i in range(m)])
        dist.barrier()
        # bf16 is timed under autocast, as the DDP engine computes (ZeRO's bf16 copy of the model is not timed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"):
            profiles[m] = measure_profile(model, samples, task.loss, opt, steps=steps)
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, {m: profile_to_dict(p) for m, p in profiles.items()})
    if rank == 0:
        out = {}
        for m in profiles:
            ps = [g[m] for g in gathered]
            out[str(m)] = {"forward_s": statistics.mean(p["forward_s"] for p in ps),
                           "backward_s": statistics.mean(p["backward_s"] for p in ps),
                           "optimizer_s": statistics.mean(p["optimizer_s"] for p in ps),
                           "ready": {k: statistics.mean(p["ready"][k] for p in ps) for k in ps[0]["ready"]},
                           "source": f"measured on the job's {world} ranks at once, no communication "
                                     f"(mean of the ranks' medians of {steps} steps)"}
        with open(out_path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    freeze_imports()  # this worker's exit walks none of torch's objects (dptrain.utils.collector)
    main()
    exit_worker(0)  # its end short of the interpreter's teardown (dptrain.utils.worker_exit)
