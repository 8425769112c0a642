"""Where each predicted step goes: the timeline, then each overhead term, beside the search's measured median.

    python docs/repro/tune_breakdown.py EXHAUSTIVE_DIR CALIBRATED_DIR

``CALIBRATED_DIR``'s calibration is refitted by the simulator on PYTHONPATH (``tune_rescore.refitted``: nothing
measured again); then for every configuration the search measured: its median, the prediction, the timeline alone,
its compute, the link's busy time, and each overhead term's milliseconds (the terms at zero left out). Run under two
commits' ``src`` to see which terms a change to the simulator moves.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_rescore import refitted, searched  # noqa: E402

from dptrain.config import load_config  # noqa: E402
from dptrain.planner.from_config import setup_for  # noqa: E402
from dptrain.planner.simulate import Overheads, simulate_step  # noqa: E402
from dptrain.planner.target import plan_target  # noqa: E402
from dptrain.tune.space import CODEC_RATIO  # noqa: E402
from dptrain.tune.tuner import planned_precision  # noqa: E402


def main(search: Path, calibrated: Path) -> None:
    cal, _ = refitted(search, calibrated)
    t, profiles, by_label = searched(search)
    model = plan_target(load_config(search / "model.toml", [])).model
    print("candidate | measured ms | predicted | timeline | compute | link busy | terms (ms)")
    for r in t["rows"]:
        if not r["measured_s"]:
            continue
        c = by_label[r["candidate"]]
        cfg = load_config(search / "model.toml", c.overrides())
        setup = setup_for(cfg, model, c.strategy, t["world_size"], planned_precision(cfg))
        p = simulate_step(model, setup, profiles[c.micro_batch], cal.network(), "native",
                          compression=CODEC_RATIO[c.codec], accum=c.accum, overheads=cal.overheads)
        terms = ", ".join(f"{name} {k * x * 1e3:.0f}" for name, k, x in
                          zip(Overheads.names(), cal.overheads.terms(), p.features, strict=True) if k * x)
        print(f"{r['candidate']} | {r['measured_s'] * 1e3:.0f} | {p.step_s * 1e3:.0f} | "
              f"{(p.step_s - p.overhead_s) * 1e3:.0f} | {p.compute_s * 1e3:.0f} | {p.comm_s * 1e3:.0f} | {terms}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
