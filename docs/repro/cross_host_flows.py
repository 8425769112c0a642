"""How a host's shared link prices one ring over every rank against concurrent pairs (issue 60, hybrid fidelity).

On the emulated 2 x 2 cluster (2 hosts of 2 ranks, each host's link limited by tbf), time gloo all-reduces in
the patterns the tuner's study runs across hosts:

- ``world``: one all-reduce of S bytes over the 4 ranks (plain ZeRO's and DDP's collectives); a ring over
  hosts A(0, 1), B(2, 3) crosses each host's link once per direction, carrying 2 * 3/4 * S;
- ``pairs``: hybrid sharding's replica all-reduces, S/2 each, over the pairs (0, 2) and (1, 3) at once: each
  rank sends S/2 over its host's link, two ranks a host, S per direction;
- ``one pair``: only (0, 2), S/2 (S/2 per direction); ``one pair, S``: only (0, 2), S (S per direction);
- ``world gather``: one all-gather of S bytes over the 4 ranks (3/4 * S per direction), as the link probe times.

Each pattern's seconds are the slowest rank's, medians over rounds whose order rotates; the effective rate is
the bytes per host link per direction over those seconds, against the link's line rate. A second table times
rank 0 alone, as ``dptrain.tune.link_probe`` does. If ``pairs`` and ``one
pair, S`` (the same bytes on the link) differ, concurrent flows share a tbf link otherwise than one; if ``world``
runs slower per byte than ``one pair, S``, the 4-rank ring pays what the cost model's α-β leaves out.

    python docs/repro/cross_host_flows.py RATE_MBIT [ROUNDS]     # as root; brings the emulated cluster up
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

SIZES = (1 << 18, 1 << 20, 1 << 22)  # fp32 elements: 1, 4, 16 MiB
PATTERNS = ("world", "pairs", "one pair", "one pair, S", "world gather")
LINK_BYTES = {"world": 1.5, "pairs": 1.0, "one pair": 0.5, "one pair, S": 1.0, "world gather": 0.75}  # per host link, per direction, x S


def worker(out: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank % 2]
    seconds: dict[str, dict[int, list[float]]] = {p: {n: [] for n in SIZES} for p in PATTERNS}
    first: dict[str, dict[int, list[float]]] = {p: {n: [] for n in SIZES} for p in PATTERNS}  # rank 0's own

    def run(pattern: str, numel: int) -> None:
        if pattern == "world":
            dist.all_reduce(torch.ones(numel))
        elif pattern == "world gather":
            dist.all_gather_into_tensor(torch.empty(numel), torch.ones(numel // 4))
        elif pattern == "pairs":
            dist.all_reduce(torch.ones(numel // 2), group=mine)
        elif rank % 2 == 0:  # only the pair (0, 2)
            dist.all_reduce(torch.ones(numel // 2 if pattern == "one pair" else numel), group=pairs[0])

    for numel in SIZES:  # warm-up: every group's connections
        for pattern in PATTERNS:
            run(pattern, numel)
    for r in range(rounds):
        for k in range(len(PATTERNS)):
            pattern = PATTERNS[(k + r) % len(PATTERNS)]
            for numel in SIZES:
                dist.barrier()
                t0 = time.perf_counter()
                run(pattern, numel)
                took = torch.zeros(dist.get_world_size(), dtype=torch.float64)
                took[rank] = time.perf_counter() - t0
                dist.all_reduce(took)
                seconds[pattern][numel].append(took.max().item())
                first[pattern][numel].append(took[0].item())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({name: {p: {str(n): v for n, v in d.items()} for p, d in times.items()}
                       for name, times in (("slowest", seconds), ("rank 0", first))}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(rate_mbit: float, rounds: int) -> None:
    import tempfile

    from dptrain.cluster import Network, run_on_cluster

    with tempfile.TemporaryDirectory() as tmp, Network(2, rate_mbit=rate_mbit) as net:
        out = os.path.join(tmp, "seconds.json")
        code = run_on_cluster(net, 2, [os.path.abspath(__file__), "--worker", out, str(rounds)], timeout=1800,
                              env={"OMP_NUM_THREADS": "1"})
        if code:
            sys.exit(f"the job failed ({code})")
        with open(out) as f:
            timed = json.load(f)
    line = rate_mbit * 1e6 / 8
    print(f"2 hosts x 2 ranks, links at {rate_mbit:g} Mbit/s ({line / 1e6:.2f} MB/s), {rounds} rounds; "
          "rate: bytes per host link per direction / seconds, of the line rate")
    for name, seconds in timed.items():
        print(f"seconds: {name}'s median")
        print(f"{'pattern':>12} " + " ".join(f"{n * 4 >> 20:>6} MiB: s    rate" for n in SIZES))
        for pattern in PATTERNS:
            cells = []
            for n in SIZES:
                s = statistics.median(seconds[pattern][str(n)])
                cells.append(f"{s:>12.3f} {LINK_BYTES[pattern] * n * 4 / s / line:>6.3f}")
            print(f"{pattern:>12} " + " ".join(cells))


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main(float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5)
