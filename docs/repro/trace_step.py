"""One step of a run's Chrome trace on one rank, span by span (docs/tune.md, the sixteenth pass).

    python docs/repro/trace_step.py RUN_DIR/trace.json [RANK]

From the second traced step's forward to the third's: each span's start (ms from that forward's), its length and its
name (forward, backward, optimizer, each collective, each wait of the training thread for one), in start order.
"""

import json
import sys


def main(path: str, rank: int = 0) -> None:
    trace = json.loads(open(path).read())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == rank]
    forwards = sorted(e["ts"] for e in spans if e["name"] == "forward")
    if len(forwards) < 3:
        raise SystemExit(f"{path}: rank {rank} traced {len(forwards)} forwards; three are needed (log.trace_steps=3)")
    t0, t1 = forwards[1], forwards[2]
    print(f"rank {rank}, one step: {(t1 - t0) / 1e3:.1f} ms")
    for e in sorted((e for e in spans if t0 <= e["ts"] < t1), key=lambda e: e["ts"]):
        print(f"{(e['ts'] - t0) / 1e3:8.1f} {e['dur'] / 1e3:7.1f}  {e['name']}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
