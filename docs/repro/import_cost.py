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
collecting). Also whether ``import dptrain.run`` left torch.distributed.checkpoint unimported. Run it on an idle
machine.
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
print(json.dumps({"cpu": time.process_time() - t, "dcp": "torch.distributed.checkpoint" in sys.modules,
                  "collecting": gc.isenabled()}))
"""


def _one(what: str, variant: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, what, variant], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    for what in ("run", "preload"):
        times: dict[str, list[float]] = {"paused": [], "collecting": []}
        ratios, dcp = [], set()
        for r in range(args.rounds):
            order = ["paused", "collecting"] if r % 2 == 0 else ["collecting", "paused"]
            got = {v: _one(what, v) for v in order}
            for v in order:
                times[v].append(got[v]["cpu"])
                assert got[v]["collecting"], f"{what} {v}: the collector was left paused"
            ratios.append(got["paused"]["cpu"] / got["collecting"]["cpu"])
            dcp.add(got["paused"]["dcp"])
        for v, ts in times.items():
            print(f"{what:8s} {v:10s} median {statistics.median(ts):.3f} s CPU (range {min(ts):.3f}-{max(ts):.3f}, "
                  f"{len(ts)} processes)")
        print(f"{what:8s} paused / collecting: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")
        if what == "run":
            print(f"run      torch.distributed.checkpoint imported by `import dptrain.run`: {sorted(dcp)}")


if __name__ == "__main__":
    main()
