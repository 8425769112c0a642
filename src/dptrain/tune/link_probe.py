"""Time gloo all-reduces and all-gathers of a few sizes between the ranks of a torchrun job; rank 0 writes the medians.

Started by ``dptrain tune`` (and ``dptrain bench cluster``) on the hosts of a job, to fit α and β of the links
the job actually gets (``dptrain.comm.fit.fit_link``), rather than trusting a nominal rate.

With ``--within-hosts`` the collectives run inside each host's group of ranks instead,
every host at once: the link between a host's ranks, under the load a sharded job puts
on it (hybrid sharding's gathers and reduce-scatters stay inside hosts). A calibration
times its links in the job that also profiles its models (:mod:`dptrain.tune.calibration_job`,
through :func:`time_links`).

    torchrun ... -m dptrain.tune.link_probe OUT.json [--within-hosts]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dptrain.launch.rendezvous import leave_process_groups
from dptrain.utils.collector import freeze_imports
from dptrain.utils.worker_exit import exit_worker

SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)  # fp32 elements: 64 KiB to 32 MiB


def main(out: str, within_hosts: bool = False, reps: int = 5) -> None:
    dist.init_process_group("gloo")
    time_links(out, within_hosts, reps)
    leave_process_groups()


def time_links(out: str, within_hosts: bool = False, reps: int = 5) -> None:
    """Time each collective at each of ``SIZES`` ``reps`` times (after one untimed) over all of the job's ranks, or
    inside each host's (``within_hosts``), in the job's process group; rank 0 writes the medians to ``out``.

    Each repeat's time is the slowest rank's (a MAX all-reduce over the job after the timing): a ring's ranks
    finish at different times, and a training step waits for the last of them. Rank 0 alone reads a 4-rank
    all-reduce across a tbf link at 1.02-1.10 of the line rate where the slowest rank reads 0.86-0.94
    (docs/repro/cross_host_flows.py, bench_results/tune20/cross_host_flows_rank0_100mbit.txt)."""
    group = None
    if within_hosts:  # torchrun numbers a host's ranks consecutively
        group, _ = dist.new_subgroups(group_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    n = dist.get_world_size(group)
    runs: list[tuple[str, int]] = []  # (collective, bytes' elements) in the order timed
    times: list[float] = []
    for numel in SIZES:
        x, shard = torch.ones(numel), torch.ones(numel // n)
        gathered = torch.empty(numel // n * n)
        for kind, collective in (("all_reduce", lambda x=x: dist.all_reduce(x, group=group)),
                                 ("all_gather", lambda g=gathered, s=shard: dist.all_gather_into_tensor(g, s,
                                                                                                         group=group))):
            collective()  # warm-up: connections, buffers
            runs.append((kind, numel // n * n if kind == "all_gather" else numel))
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                collective()
                times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # over every rank of the job, every host's group at once
    medians: dict[str, dict[int, float]] = {"all_reduce": {}, "all_gather": {}}
    for i, (kind, numel) in enumerate(runs):
        medians[kind][numel] = statistics.median(slowest[i * reps:(i + 1) * reps].tolist())
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"world_size": n, "seconds": medians, "timed": "slowest rank"}, f)


if __name__ == "__main__":
    freeze_imports()  # this worker's exit walks none of torch's objects (dptrain.utils.collector)
    main(sys.argv[1], within_hosts="--within-hosts" in sys.argv[2:])
    exit_worker(0)  # its end short of the interpreter's teardown (dptrain.utils.worker_exit)
