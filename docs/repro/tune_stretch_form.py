"""A collective slowed while the device computes beside it, as a change to the timeline, fitted and scored
(docs/tune.md, the eleventh pass).

    git worktree add /tmp/stretch b33e109 && git -C /tmp/stretch apply $PWD/docs/repro/tune_stretch_form.patch
    PYTHONPATH=/tmp/stretch/src FORM=duration|latency python docs/repro/tune_stretch_form.py \
        EXHAUSTIVE_DIR:CALIBRATION_DIR ...

Every term the earlier passes tried is added to the compute thread's time. This one moves the link's timeline
instead: a DDP bucket's all-reduce or a ZeRO-1/2 reduce-scatter that runs while backward computes takes ``1 + s``
times as long for the part of it inside backward (``duration``: the whole α-β cost; ``latency``: only its α
rounds, ``s`` times each, the bandwidth untouched), so the comm that overlapped ends later and may be exposed. The
patch (``tune_stretch_form.patch``, against b33e109) adds ``STRETCH`` and ``ALPHA_ONLY`` to
dptrain.planner.simulate; ZeRO-3's collectives and hybrid sharding's replica all-reduces are not stretched. The
stretch is not linear in the step, so it is not one more least-squares term: for each ``s`` of a grid the
calibration's twelve terms are refitted to its probes (docs/repro/tune_rescore.py's ``refitted``: nothing measured
again), and the probes' own mean error says which ``s`` the calibration would choose; each line also scores the
exhaustive search, which the calibration never sees.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_rescore import probes_choose, summary  # noqa: E402

import dptrain.planner.simulate as sim  # noqa: E402

FORMS = {"duration": [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0], "latency": [0.0, 0.25, 0.5, 1.0, 2.0, 4.0]}


def main() -> None:
    form = os.environ.get("FORM", "duration")
    if form not in FORMS or not hasattr(sim, "STRETCH"):
        raise SystemExit("FORM=duration or FORM=latency, with tune_stretch_form.patch applied (see the docstring)")
    sim.ALPHA_ONLY = form == "latency"

    def set_stretch(s: float) -> None:
        sim.STRETCH = s

    def line(s: float, probes: float, cal, rows: list[dict]) -> str:
        o = cal.overheads
        return (f"stretch {s:4.2f}: probes {100 * probes:4.1f}% | per DDP bucket {1e3 * o.per_bucket_s:.2f} ms, "
                f"per ZeRO-1/2 bucket {1e3 * o.per_zero_bucket_s:.2f} ms | trials {summary(rows).splitlines()[0]}")

    probes_choose(sys.argv[1:], FORMS[form], set_stretch, line)


if __name__ == "__main__":
    main()
