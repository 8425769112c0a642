"""What a fresh process spends importing dptrain, with and without the collector paused (``dptrain.utils.collector``).

    python docs/repro/import_cost.py [--rounds 8]

Two imports, each timed as the CPU seconds of one fresh interpreter (``time.process_time`` around the import):

- ``run``: ``import dptrain.run``, what an exec worker (torchrun's) imports first: torch, ``torch._dynamo`` (which its
  first optimizer step would import anyway) and the training loop;
- ``preload``: what a fork server imports (``dptrain.launch.workers.fork_server_preload``, plus pytest as the test
  suite's server does), ending with ``dptrain.launch.frozen``.

Each in two variants: ``paused`` as dptrain does it, and ``collecting``, the same with ``gc.disable`` made a no-op
first (so ``collector_paused`` and ``dptrain.launch.paused`` pause nothing). Rounds alternate the variants' order
(ABBA...); prints each variant's median and range, and the median and range of the per-round ratios (paused /
collecting). Also whether ``import dptrain.run`` left torch.distributed.checkpoint unimported, and what importing the
checkpoint layouts after it costs (``dptrain.checkpoint.sharded`` and ``.replicated``, which the fork server
preloads: a launcher's or exec worker's first save or resume).

Last, in one more process per round, what the paused preload leaves (the fork server's list less
``dptrain.launch.frozen``): the objects the collector tracks and the resident set, then what a ``gc.collect()``
takes and finds (the unreachable objects it reports), the objects it tracks after it (fewer: the garbage freed,
and the tuples and dicts of atoms it stops tracking as it walks them) and the resident set after it. Run it on an
idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import gc, json, sys, time
if sys.argv[2] == "collecting":
    gc.disable = lambda: None
t = time.process_time()
if sys.argv[1] == "run":
    import dptrain.run
else:
    from dptrain.launch.workers import fork_server_preload
    for name in fork_server_preload(["pytest"]):
        __import__(name)
cpu = time.process_time() - t
dcp = "torch.distributed.checkpoint" in sys.modules
t = time.process_time()
import dptrain.checkpoint.replicated, dptrain.checkpoint.sharded
print(json.dumps({"cpu": cpu, "dcp": dcp, "layouts": time.process_time() - t, "collecting": gc.isenabled()}))
"""

GARBAGE = r"""
import gc, json, time
from dptrain.launch.workers import fork_server_preload

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

for name in fork_server_preload(["pytest"])[:-1]:  # paused, the rest, not frozen
    __import__(name)
tracked, before = len(gc.get_objects()), rss()
t = time.process_time()
cycles = gc.collect()
print(json.dumps({"tracked": tracked, "cycles": cycles, "collect_s": time.process_time() - t,
                  "tracked_after": len(gc.get_objects()), "rss": before, "rss_after": rss()}))
"""


def _one(what: str, variant: str, code: str = CHILD) -> dict:
    out = subprocess.run([sys.executable, "-c", code, what, variant], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _range(values: list[float], fmt: str) -> str:
    return f"median {statistics.median(values):{fmt}} (range {min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    for what in ("run", "preload"):
        times: dict[str, list[float]] = {"paused": [], "collecting": []}
        ratios, dcp, layouts = [], set(), []
        for r in range(args.rounds):
            order = ["paused", "collecting"] if r % 2 == 0 else ["collecting", "paused"]
            got = {v: _one(what, v) for v in order}
            for v in order:
                times[v].append(got[v]["cpu"])
                assert got[v]["collecting"], f"{what} {v}: the collector was left paused"
            ratios.append(got["paused"]["cpu"] / got["collecting"]["cpu"])
            dcp.add(got["paused"]["dcp"])
            layouts.append(got["paused"]["layouts"])
        for v, ts in times.items():
            print(f"{what:8s} {v:10s} median {statistics.median(ts):.3f} s CPU (range {min(ts):.3f}-{max(ts):.3f}, "
                  f"{len(ts)} processes)")
        print(f"{what:8s} paused / collecting: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")
        if what == "run":
            print(f"run      torch.distributed.checkpoint imported by `import dptrain.run`: {sorted(dcp)}")
            print(f"run      then the checkpoint layouts, paused run: {_range(layouts, '.3f')} s CPU")
    left = [_one("preload", "paused", GARBAGE) for _ in range(args.rounds)]
    print(f"garbage  the paused preload leaves {_range([g['tracked'] for g in left], ',')} tracked objects, "
          f"resident {_range([g['rss'] for g in left], '.1f')} MiB")
    print(f"garbage  gc.collect() then: {_range([g['collect_s'] for g in left], '.3f')} s CPU, "
          f"{_range([g['cycles'] for g in left], ',')} unreachable objects reported; "
          f"{_range([g['tracked_after'] for g in left], ',')} tracked after it; "
          f"resident after {_range([g['rss_after'] for g in left], '.1f')} MiB")


if __name__ == "__main__":
    main()
