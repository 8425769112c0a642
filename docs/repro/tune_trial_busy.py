"""What a search's DDP trials spent on the link, from their own metrics (docs/tune.md, the tenth pass).

    python docs/repro/tune_trial_busy.py EXHAUSTIVE_DIR ...

For each DDP trial run (every round), the medians over its timed steps (after the 4 warm-up steps) of the step,
compute, exposed communication and the link's busy time (``comm_busy_ms``: from each bucket's launch to its end),
and the bytes a rank sent. Nothing is run.
"""

import statistics
import sys
from pathlib import Path

from dptrain.pages.plots import read_metrics

WARMUP = 4


def main() -> None:
    for search in map(Path, sys.argv[1:]):
        print(search)
        for run in sorted(search.glob("trials/*-ddp_*/run/metrics.jsonl")):
            records = [r for r in read_metrics(run)[0] if r.get("kind") == "train" and r["step"] > WARMUP]
            if not records:
                continue

            def median(key: str, rs: list = records) -> float:
                return statistics.median(r[key] for r in rs)

            name = run.parent.parent.name.split("-", 1)[1]
            print(f"  {name:28s} step {median('step_ms'):6.1f} compute {median('compute_ms'):6.1f} exposed "
                  f"{median('exposed_comm_ms'):6.1f} busy {median('comm_busy_ms'):6.1f} ms, sent "
                  f"{records[-1]['comm_sent_bytes_per_step'] / 1e6:5.1f} MB")


if __name__ == "__main__":
    main()
