"""A collective's latency under compute contention, as a thirteenth overhead term, refitted and scored (docs/tune.md).

    python docs/repro/tune_contention_form.py base|inside|after|rounds|hosts|host-rounds EXHAUSTIVE_DIR:CALIBRATION_DIR ...

``base``: the simulator's twelve terms; ``inside``: a thirteenth, per collective while the device computes (each
collective counted by the share of its time inside a compute window: a round's latency when every rank's cores are
busy computing, where ``contention_s_per_byte`` charges bandwidth); ``after``: the thirteenth per collective that
runs outside compute instead (the queue after backward); ``rounds``: no thirteenth term, the per-collective ones
(DDP bucket, ZeRO-1/2 bucket, ZeRO-3 collective, coded bucket) scaled by the collective's group's ring rounds against
the whole world's, ``(g - 1) / (N - 1)``: hybrid sharding's groups of 2 charged a third of 4 ranks'; ``hosts``: the
thirteenth per collective of a shard group inside one host while the world spans several (hybrid sharding's groups on
2 x 2), in place of the per-collective terms, which then count only groups that span hosts; ``host-rounds``: no
thirteenth term, ``rounds``' scaling only for a shard group inside one host while the world spans several. Each
calibration (``CALIBRATION_DIR/calibration.json`` with its profiles, e.g. a tuner's directory) is refitted with the
form (docs/repro/tune_refit.py: nothing is measured again) and the exhaustive search in ``EXHAUSTIVE_DIR`` scored
against it (docs/repro/tune_rescore.py), with the tuner's pick (the best of the 3 predicted fastest, by the
search's medians) over the optimum.
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_calibration_length import score  # noqa: E402
from tune_rescore import refitted, summary  # noqa: E402

import dptrain.planner.calibration as calibration  # noqa: E402
import dptrain.planner.simulate as sim  # noqa: E402
import dptrain.tune.calibrate as calmod  # noqa: E402
import dptrain.tune.tuner as tunermod  # noqa: E402

MODE = "base"  # the form in use: use_form() sets it


@dataclasses.dataclass(frozen=True)
class Overheads13(sim.Overheads):
    """The twelve terms and one more: per collective inside (``inside``) or outside (``after``) compute."""

    per_contended_collective_s: float = 0.0


original_features = sim._features


def features(log, calls, windows, *args, **kwargs):
    """The twelve features and the thirteenth: the collectives' count, each by its share inside the windows."""
    base = original_features(log, calls, windows, *args, **kwargs)
    inside = 0.0
    for c in log:
        span = c.end_s - c.start_s
        if span > 0:
            share = sum(max(0.0, min(c.end_s, hi) - max(c.start_s, lo)) for lo, hi in windows) / span
            inside += share if MODE == "inside" else 1.0 - share
    return (*base, inside if MODE in ("inside", "after") else 0.0)


original_step = sim.simulate_step


def refeatured(p, features, overheads):
    """``p`` (a step predicted without overheads) with ``features`` in place of its own, and their overheads added."""
    o = sum(x * y for x, y in zip((overheads or sim.Overheads()).terms(), features, strict=True))
    return dataclasses.replace(p, features=tuple(features), overhead_s=o, step_s=p.step_s + o)


def rounds_step(model, setup, *args, **kwargs):
    """The step with the per-collective features scaled by ``(g - 1) / (N - 1)``, g the shard group's ranks."""
    overheads = kwargs.pop("overheads", None)
    p = original_step(model, setup, *args, **kwargs)
    f = list(p.features)
    for i in (1, 2, 3, 10):
        f[i] *= (setup.shards - 1) / max(1, setup.world_size - 1)
    return refeatured(p, f, overheads)


def host_rounds_step(model, setup, profile, network, *args, **kwargs):
    """``rounds_step``'s scaling only where the shard group is inside one host and the world spans several (hybrid
    sharding's groups on 2 x 2, over loopback); a group that spans hosts (on 4 x 1) pays the whole per-collective
    cost, as in the simulator."""
    overheads = kwargs.pop("overheads", None)
    p = original_step(model, setup, profile, network, *args, **kwargs)
    f = list(p.features)
    per = network.per_node
    if -(-setup.shards // per) == 1 < -(-setup.world_size // per):
        for i in (1, 2, 3, 10):
            f[i] *= (setup.shards - 1) / max(1, setup.world_size - 1)
    return refeatured(p, f, overheads)


def hosts_step(model, setup, profile, network, *args, **kwargs):
    """The step with the per-collective features moved to the thirteenth where the shard group is inside one host
    and the world spans several (hybrid sharding's groups on 2 x 2): a collective over loopback, not the link."""
    overheads = kwargs.pop("overheads", None)
    p = original_step(model, setup, profile, network, *args, **kwargs)
    f = list(p.features)
    per = network.per_node
    if -(-setup.shards // per) == 1 < -(-setup.world_size // per):
        f[12] = sum(f[i] for i in (1, 2, 3, 10))
        for i in (1, 2, 3, 10):
            f[i] = 0.0
    return refeatured(p, f, overheads)


def use_form(mode: str) -> None:
    """Make the simulator, the calibration's fit and the tuner use ``mode``'s thirteen terms (this process only)."""
    global MODE
    if mode not in ("base", "inside", "after", "rounds", "hosts", "host-rounds"):
        raise SystemExit(f"unknown form {mode!r}: base, inside, after, rounds, hosts or host-rounds")
    MODE = mode
    sim.Overheads = calibration.Overheads = Overheads13
    sim._features = features
    sim.StepPrediction.__dataclass_fields__["features"].default = (0.0,) * 13
    step = {"rounds": rounds_step, "hosts": hosts_step, "host-rounds": host_rounds_step}.get(mode, original_step)
    sim.simulate_step = calmod.simulate_step = tunermod.simulate_step = step


def main() -> None:
    use_form(sys.argv[1])
    for pair in sys.argv[2:]:
        search, tuned = (Path(p) for p in pair.split(":"))
        cal, rows = refitted(search, tuned)
        o = cal.overheads
        print(f"{MODE:6s} {search.parent.name}/{search.name} <- {tuned.parent.name}: pick {score(rows)['pick']}, "
              f"per DDP bucket {1e3 * o.per_bucket_s:.2f} ms, per ZeRO-1/2 bucket "
              f"{1e3 * o.per_zero_bucket_s:.2f} ms, per contended collective {1e3 * o.per_contended_collective_s:.2f} "
              f"ms, contention {1e3 * 1e6 * o.contention_s_per_byte:.3f} ms/MB | {summary(rows)}")


if __name__ == "__main__":
    main()
