"""Time gloo all-reduces of a few sizes between the ranks of a torchrun job; rank 0 writes the medians.

Started by ``dptrain bench cluster`` on the emulated hosts, to fit α and β of the links
the job actually gets (``dptrain.comm.fit.fit_link``), rather than trusting a nominal rate.

    torchrun ... -m dptrain.bench.link_probe OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dptrain.launch.rendezvous import leave_process_groups

SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)  # fp32 elements: 64 KiB to 32 MiB


def main(out: str, reps: int = 5) -> None:
    dist.init_process_group("gloo")
    medians = {}
    for numel in SIZES:
        x = torch.ones(numel)
        dist.all_reduce(x)  # warm-up: connections, buffers
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        medians[numel] = statistics.median(times)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "seconds": medians}, f)
    leave_process_groups()


if __name__ == "__main__":
    main(sys.argv[1])
