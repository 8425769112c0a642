"""What launching one asynchronous all-reduce costs the calling thread, by the route it takes (issue 60).

Run: ``torchrun --nproc-per-node 2 docs/repro/launch_cost.py``. Each round times 50 launches of each
route, interleaved route by route, each launch alone (the wait is outside the clock), on a 4 KiB tensor:
``dptrain.comm.all_reduce`` (as the DDP engine's hook called it before), ``PersistentAllReduce.start``
(as it calls it now), ``dist.all_reduce`` and the process group's own ``allreduce`` (what torch's C++
reducer calls). Prints the median over rounds of each round's median launch, in microseconds.
"""

import statistics
import time

import torch
import torch.distributed as dist

from dptrain import comm


def main(rounds: int = 30, launches: int = 50) -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    x = torch.zeros(1024)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    prepared = comm.PersistentAllReduce(x, validate=False)
    routes = {
        "dptrain.comm.all_reduce": lambda: comm.all_reduce(x, async_op=True, validate=False, timed=False),
        "PersistentAllReduce.start": prepared.start,
        "dist.all_reduce": lambda: dist.all_reduce(x, async_op=True),
        "ProcessGroup.allreduce": lambda: group.allreduce([x], opts),
    }
    medians: dict[str, list[float]] = {name: [] for name in routes}
    for r in range(rounds):
        names = list(routes)[r % len(routes):] + list(routes)[:r % len(routes)]  # rotate the order
        for name in names:
            times = []
            for _ in range(launches):
                started = time.perf_counter()
                work = routes[name]()
                times.append(time.perf_counter() - started)
                work.wait()
            medians[name].append(statistics.median(times))
    if dist.get_rank() == 0:
        for name, values in medians.items():
            print(f"{name:28s} {statistics.median(values) * 1e6:7.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
