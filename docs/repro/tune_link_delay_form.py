"""A per-collective delay on the link's timeline instead of (or beside) the compute thread's, fitted and scored
(docs/tune.md, the tenth pass).

    python docs/repro/tune_link_delay_form.py coded|ddp EXHAUSTIVE_DIR:CALIBRATION_DIR ...

The simulator charges a DDP bucket's and a codec's per-bucket cost on the compute thread (``per_bucket_s``,
``per_coded_bucket_s``), where it adds to the step only as itself. A cost that holds the link instead, such as the
hand-offs between the backend's thread, the codec's progress thread and the interpreter's lock that a reduction
waits for before the next can start, delays every later bucket, and is exposed only where the link is busy. Here
each DDP all-reduce (``ddp``) or each one a codec reduces (``coded``) lasts ``d`` longer on the link; ``d`` is not
linear in the step, so for each ``d`` of a grid the twelve terms are refitted to the calibration's probes
(docs/repro/tune_rescore.py's ``refitted``: nothing measured again), and the probes' own mean error says which ``d``
the calibration would choose. Each line also scores the exhaustive search, which the calibration never sees.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_calibration_length import score  # noqa: E402
from tune_rescore import probes_choose, summary  # noqa: E402

import dptrain.planner.simulate as sim  # noqa: E402

GRID_MS = [0.0, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0]
DELAY = {"s": 0.0, "form": "coded"}
original = sim._durations


def delayed(setup, network, algorithm, ranks, shard, compression=1):
    """``_durations`` with ``DELAY['s']`` added to each DDP all-reduce of the shard group (all, or the coded ones)."""
    duration = original(setup, network, algorithm, ranks, shard, compression=compression)
    applies = shard and setup.stage == 0 and (compression > 1 or DELAY["form"] == "ddp")

    def timed(kind, unit):
        seconds, nbytes = duration(kind, unit)
        return (seconds + DELAY["s"] if applies and kind == "all_reduce" and seconds > 0 else seconds), nbytes

    return timed


def main() -> None:
    DELAY["form"] = sys.argv[1]
    if DELAY["form"] not in ("coded", "ddp"):
        raise SystemExit("the form: coded or ddp")
    sim._durations = delayed

    def set_delay(ms: float) -> None:
        DELAY["s"] = ms / 1e3

    def line(ms: float, probes: float, cal, rows: list[dict]) -> str:
        o = cal.overheads
        return (f"delay {ms:4.1f} ms: probes {100 * probes:4.1f}% | per DDP bucket {1e3 * o.per_bucket_s:.2f} ms, "
                f"per coded bucket {1e3 * o.per_coded_bucket_s:.2f} ms | trials {summary(rows).splitlines()[0]}, "
                f"pick {score(rows)['pick']}")

    probes_choose(sys.argv[2:], GRID_MS, set_delay, line, " ms")


if __name__ == "__main__":
    main()
