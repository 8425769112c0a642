"""Measure a :class:`~dptrain.planner.calibration.Calibration` on the machine at hand: links, then overheads.

1. **Links.** :mod:`dptrain.tune.link_probe` times gloo all-reduces and all-gathers of
   64 KiB to 32 MiB over all ranks, and (several hosts of several ranks) inside each
   host, every host at once; α and β are fitted to each set with the cost model's rounds
   and bytes (:func:`fit_probe`). On one host the two are the same link. The links and
   every model's compute profile below (the tuned model's too, where the tuner asks) are
   timed in one job (:mod:`dptrain.tune.calibration_job`, :func:`measure_machine`).
2. **Overheads.** Short ``dptrain run`` jobs of two probe models (the built-in
   character GPT at 2 layers x 128 and 6 x 320, none the size of a model it is used
   for; ``PROBE_MODELS``) under one planned strategy of each kind of step (:func:`probe_variants`:
   DDP and ZeRO-1 each with small and large buckets, DDP and ZeRO-2 with accumulation,
   DDP with the bf16 codec at small and large buckets, ZeRO-3 and, where the world
   allows, hybrid ZeRO-1 and ZeRO-3); each probe's compute is timed on
   all ranks at once
   (:mod:`dptrain.tune.compute_probe`), the simulator replays its step on the fitted
   links without overheads, and :func:`~dptrain.planner.calibration.fit_overheads`
   fits the thirteen terms to what the timeline misses (a term no probe can tell apart is
   held at zero and named). Each probe runs ``rounds`` times (``PROBE_ROUNDS``, one), interleaved (the median
   counts), for ``PROBE_STEPS`` steps; a probe whose one run's steps, or whose runs, deviate by over 5% of their
   median runs again, up to two more times (:func:`~dptrain.tune.probe_length.unsettled`; in a
   one-round calibration, in the round's own job). On this machine's own
   ranks and on the emulated cluster each round's probes run one after another in one job
   (:mod:`dptrain.tune.probe_runs`), each in a process group of its own; under a launcher one job each, as trials
   (``Machine.probes_in_one_job``).

The probes use the built-in task, whatever the user's model: the calibration belongs to
the machine and is reused for any model (``dptrain tune --calibration FILE``).
"""

from __future__ import annotations

import datetime
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from dptrain.comm.cost import Link, collective_cost
from dptrain.comm.fit import fit_link
from dptrain.config import load_config
from dptrain.planner.calibration import Calibration, ProbeRun, fit_overheads
from dptrain.planner.from_config import setup_for
from dptrain.planner.network import Network
from dptrain.planner.simulate import ComputeProfile, StepPrediction, simulate_step
from dptrain.planner.target import plan_target
from dptrain.strategies import get_strategy, strategy_names
from dptrain.tune.compute_probe import profile_from_dict
from dptrain.tune.machine import JOB_ERRORS, Machine, where_kept
from dptrain.tune.probe_length import PROBE_EXTRA, PROBE_ROUNDS, PROBE_STEPS, PROBE_WARMUP, unsettled
from dptrain.tune.probe_runs import run_probes
from dptrain.tune.search import Measured, TrialFailed
from dptrain.tune.space import CODEC_RATIO
from dptrain.tune.trials import run_trial, write_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["PROBE_MODELS", "probe_variants", "probe_timelines", "probe_stem", "fit_probe", "measure_machine",
           "measure_profiles", "read_profiles", "probe_bases", "calibrate", "refit"]

# (model overrides, micro-batch per rank): two sizes, so per-collective, per-byte and compute costs can be told
# apart. A third between them (3 x 224 at micro-batch 12) moved no choice and the mean error by -0.2 to +0.7
# points in eight calibrations of four cluster settings, refitted without it, and took a quarter to two-fifths of
# the probes' time (docs/repro/tune_probe_subsets.py, docs/tune.md)
PROBE_MODELS = ((["gpt.n_layer=2", "gpt.n_embd=128"], 4), (["gpt.n_layer=6", "gpt.n_embd=320"], 2))


ProbeBase = tuple[int, Path, int, list[str]]  # a probe model: index, base config, micro-batch, model overrides
ModelRequest = tuple[Path, list[int], Path]  # a model to profile beside the probes: config, micro-batches, output

PROBE_ACCUM = 3  # the accumulation probes' micro-steps per step: two of them accumulate without reducing
PROBE_CODEC = "bf16"  # the codec probes' (fp16 costs the same passes: a division, a cast, error feedback's residual)


def probe_variants(world_size: int, per_host: int, micro_batch: int = 1) -> dict[str, list[str]]:
    """The strategies each probe model runs under: the first planned strategy of each kind of step the simulator
    times apart (replicated or sharded, bucketed or per unit: DDP, ZeRO-1 and ZeRO-3 today). A bucketed kind runs at
    many and at few buckets (its per-bucket overhead apart from its per-byte one), and with ``PROBE_ACCUM``
    micro-steps per step (``micro_batch`` samples each) under its strategy that shards the most (ZeRO-2 of ZeRO-1/2:
    the one that accumulates into a buffer of its own, so the probes see both micro-step terms), and, where that kind
    takes a gradient codec, with ``PROBE_CODEC`` at many and at few buckets; a sharded kind also hybrid where the
    world allows (a bucketed one at few buckets): a shard group per host, or with one rank per host, groups of 2
    across hosts, whose collectives share each rank's link with the replica all-reduces (``shared_wire``), a
    bucketed one there at many buckets too."""
    kinds: dict[tuple[bool, bool], str] = {}
    deepest: dict[tuple[bool, bool], str] = {}
    for name in strategy_names(lambda s: s.planned):
        entry = get_strategy(name)
        kind = (entry.shards_parameters, entry.buckets)
        kinds.setdefault(kind, name)
        if kind not in deepest or entry.zero_stage > get_strategy(deepest[kind]).zero_stage:
            deepest[kind] = name
    shard = None
    if 1 < per_host < world_size:
        shard = per_host  # a shard group per host
    elif per_host == 1 and world_size >= 4 and world_size % 2 == 0:
        shard = 2  # pairs across hosts, replicated over at least 2 pairs
    accum = [f"train.global_batch_size={micro_batch * world_size * PROBE_ACCUM}", f"train.micro_batch_size={micro_batch}",
             f"train.grad_accum_steps={PROBE_ACCUM}"]
    out = {}
    for kind, name in kinds.items():
        sharded, bucketed = kind
        strategy = [f'distributed.strategy="{name}"']
        if bucketed:
            out[f"{name} 0.25MiB"] = [*strategy, "ddp.bucket_cap_mb=0.25"]
            out[f"{name} 25MiB"] = [*strategy, "ddp.bucket_cap_mb=25"]
            out[f"{deepest[kind]} 25MiB accum{PROBE_ACCUM}"] = [f'distributed.strategy="{deepest[kind]}"',
                                                               "ddp.bucket_cap_mb=25", *accum]
            if not sharded and get_strategy(name).accepts_codec(PROBE_CODEC):
                for cap in ("0.25", "25"):
                    out[f"{name} {cap}MiB {PROBE_CODEC}"] = [*strategy, f"ddp.bucket_cap_mb={cap}",
                                                             f'compression.method="{PROBE_CODEC}"']
        else:
            out[name] = strategy
        if sharded and shard is not None:
            hybrid = [*strategy, f"zero.shard_size={shard}"]
            if not bucketed:
                out[f"{name}/hybrid{shard}"] = hybrid
                continue
            out[f"{name}/hybrid{shard} 25MiB"] = [*hybrid, "ddp.bucket_cap_mb=25"]
            if per_host == 1:  # many small reductions beside their all-reduces: where the two groups take turns
                out[f"{name}/hybrid{shard} 0.25MiB"] = [*hybrid, "ddp.bucket_cap_mb=0.25"]
    return out


def fit_probe(probe: dict, kinds: tuple[str, ...]) -> Link:
    """α and β fitted to a link probe's timings (``{"world_size", "seconds": {kind: {numel: s}}}``) of ``kinds``,
    each costed as the ring the cost model takes ``native`` collectives to be."""
    rounds, nbytes, seconds = [], [], []
    for kind in kinds:
        for numel, t in probe["seconds"][kind].items():
            cost = collective_cost(kind, "native", int(numel), 4, probe["world_size"])
            rounds.append(cost.steps())
            nbytes.append(cost.load(duplex=True))
            seconds.append(t)
    return fit_link(rounds, nbytes, seconds)


def _probe_job(machine: Machine, args: list[str], timeout: float, errors: Path) -> None:
    """Run the measuring job ``args`` on ``machine``; a :class:`~dptrain.tune.search.TrialFailed` naming it and its
    exit where it fails, its whole error output kept in ``errors``."""
    code, tail = machine.job(args, timeout, errors=errors)
    if code != 0:
        raise TrialFailed(f"the probe {' '.join(args[:2])} exited with {code}" + (f": {tail}" if tail else "")
                           + where_kept(errors))


def measure_machine(machine: Machine, work: Path, bases: list[ProbeBase],
                    models: Sequence[ModelRequest] = (), timeout: float = 900) -> tuple[Link, Link,
                                                                                     dict[int, ComputeProfile]]:
    """(inside a host, across hosts) as fitted on ``machine`` (on one host, or one rank a host, both its one link)
    and every probe model's compute profile (:func:`probe_bases`, each at its micro-batch) by index, written to
    ``profile.json`` beside its base config: all from one job (:mod:`dptrain.tune.calibration_job`), one start, not
    one per measurement. Each of ``models`` (config, micro-batch sizes, output) is profiled in the same job, into
    its output (:func:`read_profiles`)."""
    links = work / "links"
    links.mkdir(parents=True, exist_ok=True)
    within = machine.hosts > 1 and machine.per_host > 1
    args = ["-m", "dptrain.tune.calibration_job", "--links", str(links / "link_all.json")]
    if within:
        args += ["--links-within", str(links / "link_inside.json")]
    for _, base, micro, _ in bases:
        args += ["--probe", str(base.with_name("profile.json")), str(base), str(micro)]
    for config, micro_batches, out in models:
        args += ["--probe", str(out), str(config), ",".join(str(m) for m in sorted(set(micro_batches), reverse=True))]
    _probe_job(machine, args, timeout, work / f"calibration.{JOB_ERRORS}")
    both = ("all_reduce", "all_gather")
    across = fit_probe(json.loads((links / "link_all.json").read_text()), both)
    inside = fit_probe(json.loads((links / "link_inside.json").read_text()), both) if within else across
    profiles = {i: read_profiles(base.with_name("profile.json"))[micro] for i, base, micro, _ in bases}
    return inside, across, profiles


def read_profiles(path: Path) -> dict[int, ComputeProfile]:
    """The compute profiles a profiling job wrote to ``path``, by micro-batch size."""
    return {int(m): profile_from_dict(p) for m, p in json.loads(path.read_text()).items()}


def measure_profiles(machine: Machine, config: Path, micro_batches: list[int], out: Path,
                     timeout: float = 900) -> dict[int, ComputeProfile]:
    """The compute profile of ``config``'s model at each micro-batch size, timed on all of ``machine``'s ranks."""
    args = ["-m", "dptrain.tune.compute_probe", str(out), "--config", str(config),
            "--micro-batches", ",".join(str(m) for m in sorted(set(micro_batches), reverse=True))]
    _probe_job(machine, args, timeout, out.with_name(f"{out.stem}.{JOB_ERRORS}"))
    return read_profiles(out)


def calibrate(machine: Machine, work: Path, steps: int = PROBE_STEPS, warmup: int = PROBE_WARMUP, timeout: float = 600,
              rounds: int = PROBE_ROUNDS, log: Callable[[str], None] = print,
              models: Sequence[ModelRequest] = ()) -> Calibration:
    """Measure ``machine``'s links and fit its overheads to the probe runs (the module's docstring). Each of
    ``models`` (config, micro-batch sizes, output: the tuned model's) is profiled in the job that profiles the
    probe models, into its output (:func:`read_profiles`)."""
    bases = probe_bases(work, machine.world_size)
    inside, across, profiles = measure_machine(machine, work, bases, models, timeout)
    log(f"links: inside a host alpha {inside.alpha * 1e3:.2f} ms, beta {inside.beta * 8 / 1e9:.2f} Gbit/s; "
        f"across hosts alpha {across.alpha * 1e3:.2f} ms, beta {across.beta * 8 / 1e9:.2f} Gbit/s")
    cal = Calibration(machine.where, datetime.date.today().isoformat(), machine.hosts, machine.per_host, "gloo",
                      machine.shared_net, inside, across)
    network, world = cal.network(), machine.world_size
    runs = probe_timelines(bases, world, machine.per_host, network, lambda i, base, micro: profiles[i])
    measured: dict[str, list[Measured]] = {label: [] for label, *_ in runs}
    again = PROBE_EXTRA if rounds == 1 and machine.probes_in_one_job else 0  # one round: its reruns in its job
    r, todo = 0, runs
    while todo:  # interleaved, each round from a different start
        order = todo[r % len(todo):] + todo[:r % len(todo)]
        trials = [(work / "probes" / f"{probe_stem(label)}-r{r}", base, variant) for label, base, variant, _ in order]
        for (label, *_), got in zip(order, _probe_round(machine, trials, steps, warmup, timeout, again), strict=True):
            measured[label] += got
        r += 1 + again
        todo = runs if r < rounds else [run for run in runs if unsettled(measured[run[0]], rounds)]
    probes = []
    for label, _, _, timeline in runs:
        step_s = [m.step_s for m in measured[label]]
        probes.append(ProbeRun(label, statistics.median(step_s), timeline.step_s, timeline.features))
        log(f"probe {label}: measured {probes[-1].measured_s * 1e3:.1f} ms "
            f"({', '.join(f'{x * 1e3:.1f}' for x in step_s)}), timeline {timeline.step_s * 1e3:.1f} ms")
    cal.probes = probes
    cal.overheads = fit_overheads(probes)
    _log_fit(cal, log)
    return cal


def probe_stem(label: str) -> str:
    """A probe's run directories' name, less the round (``-r<round>``): its label as a file name."""
    return label.replace("/", "-").replace(" ", "_")


def _probe_round(machine: Machine, trials: list[tuple[Path, Path, list[str]]], steps: int, warmup: int,
                 timeout: float, again: int = 0) -> list[list[Measured]]:
    """Each probe's runs: all in one job where the machine times them as jobs of their own would
    (``Machine.probes_in_one_job``), each probe run ``again`` more times there while unsettled
    (:func:`~dptrain.tune.probe_length.unsettled`, into ``-r<round + 1>``...); else one job each, as trials run."""
    if machine.probes_in_one_job:
        return run_probes(machine, trials, steps, warmup, timeout, again)
    return [[run_trial(machine, base, variant, trial, steps, warmup, timeout)] for trial, base, variant in trials]


def _log_fit(cal: Calibration, log: Callable[[str], None]) -> None:
    o = cal.overheads
    log(f"overheads: {o.per_step_s * 1e3:.2f} ms per step, {o.per_bucket_s * 1e3:.3f} ms per DDP bucket, "
        f"{o.per_zero_bucket_s * 1e3:.3f} ms per ZeRO-1/2 bucket, {o.per_zero_unit_s * 1e3:.3f} ms per ZeRO-3 "
        f"collective, {o.contention_s_per_byte * 1e9:.3f} ms per MB communicated beside compute, "
        f"{o.comm_s_per_byte * 1e9:.3f} ms per MB communicated, "
        f"{o.state_s_per_byte * 1e9:.3f} ms per MB of parameters stepped, compute slowed by "
        f"{100 * o.compute_slowdown:.1f}%, {o.per_micro_step_s * 1e3:.2f} ms per accumulating micro-step "
        f"(+{o.micro_step_s_per_byte * 1e9:.3f} ms per MB accumulated into a buffer of the engine's own), "
        f"{o.per_coded_bucket_s * 1e3:.3f} ms per bucket a codec reduces "
        f"(+{o.coded_s_per_byte * 1e9:.3f} ms per MB it encodes)")
    unidentified = cal.unidentified()
    if unidentified:
        log(f"  not identified by these probes, held at zero: {', '.join(unidentified)}")
    for r in cal.residuals():
        log(f"  fitted {r['label']}: {r['fitted_s'] * 1e3:.1f} ms, measured {r['measured_s'] * 1e3:.1f} "
            f"({r['ratio']:.3f})")


def probe_timelines(bases: list[ProbeBase], world: int, per_host: int, network: Network,
                    profile: Callable[[int, Path, int], ComputeProfile]) -> list[tuple[str, Path, list[str], StepPrediction]]:
    """Every probe of :func:`probe_variants` on each probe model (``bases``, :func:`probe_bases`): (label, base config,
    variant overrides, the simulator's timeline without overheads); ``profile(i, base, micro)`` gives model ``i``'s
    compute profile."""
    runs = []
    for i, base, micro, model_overrides in bases:
        compute = profile(i, base, micro)
        model = plan_target(load_config(base)).model
        for name, variant in probe_variants(world, per_host, micro).items():
            cfg = load_config(base, variant)
            setup = setup_for(cfg, model, cfg.distributed.strategy, world, "fp32")
            label = f"{'x'.join(o.split('=')[1] for o in model_overrides)} {name}"
            coded = CODEC_RATIO[cfg.compression.method]  # "none", or the codec probes'
            runs.append((label, base, variant, simulate_step(model, setup, compute, network, "native",
                                                             compression=coded,
                                                             accum=cfg.train.grad_accum_steps or 1)))
    return runs


def probe_bases(work: Path, world: int, models: Sequence[tuple[list[str], int]] = PROBE_MODELS) -> list[ProbeBase]:
    """(index, base config written to ``work/probe<i>/model.toml``, micro-batch, model overrides) of each of
    ``models`` (``PROBE_MODELS``) on ``world`` ranks."""
    bases = []
    for i, (model_overrides, micro) in enumerate(models):
        batch = [f"train.global_batch_size={micro * world}", f"train.micro_batch_size={micro}"]
        base = write_config(work / f"probe{i}" / "model.toml", None, [*model_overrides, *batch])
        bases.append((i, base, micro, model_overrides))
    return bases


def refit(measured: Path, work: Path, log: Callable[[str], None] = print,
          models: Sequence[tuple[list[str], int]] | None = None) -> Calibration:
    """The overheads fitted anew, by today's simulator, to the probe runs of an earlier calibration: its links, its
    probes' measured steps (``measured``: a tune directory's calibration.json, of any version) and compute profiles
    (the ``calibration/probe*/profile.json`` beside it, found by the model in the ``model.toml`` beside each, whatever
    its index then). ``models``: the probe models whose runs count, by default the ones that calibration probed
    (its ``model.toml`` files, smallest first; without them refit says what is missing), so that a study of an earlier
    calibration refits what it ran, whatever dptrain probes today. A probe that run did not have is left out; a
    term no probe left identifies is held at zero and named. For studies of the terms' form: nothing is measured
    again."""
    d = json.loads(measured.read_text())
    links = {k: Link(float(d[k]["alpha"]), float(d[k]["beta"]), float(d[k]["gamma"]), bool(d[k]["duplex"]))
             for k in ("inside", "across")}
    cal = Calibration(str(d["where"]), str(d["taken"]), int(d["hosts"]), int(d["per_host"]), str(d["backend"]),
                      bool(d["shared_net"]), links["inside"], links["across"])
    steps = {str(p["label"]): float(p["measured_s"]) for p in d["probes"]}
    tomls = sorted((measured.parent / "calibration").glob("probe*/model.toml"), key=_gpt_shape)
    if not tomls:
        raise ValueError(f"{measured.parent / 'calibration'} holds no probe model (probe*/model.toml beside its "
                         "profile.json): refit times the probes again on the compute profiles that calibration "
                         "measured, kept in its tune directory; copy that directory whole, calibration/ included")
    earlier = {_gpt_shape(toml): toml.parent for toml in tomls}
    if models is None:
        models = [_probe_model(toml) for toml in tomls]
    world = cal.hosts * cal.per_host
    bases = [b for b in probe_bases(work, world, models) if _gpt_shape(b[1]) in earlier]

    def profile(i: int, base: Path, micro: int) -> ComputeProfile:
        path = earlier[_gpt_shape(base)] / "profile.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing: refit needs the compute profiles its calibration measured")
        return profile_from_dict(json.loads(path.read_text())[str(micro)])

    runs = probe_timelines(bases, world, cal.per_host, cal.network(), profile)
    cal.probes = [ProbeRun(label, steps[label], t.step_s, t.features) for label, _, _, t in runs if label in steps]
    dropped = sorted(set(steps) - {label for label, *_ in runs})
    if dropped:
        log(f"  runs of probes today's calibration does not make, left out: {', '.join(dropped)}")
    if not cal.probes:
        raise ValueError(f"none of the {len(steps)} probe runs in {measured} is a probe of today's calibration for "
                         f"{cal.hosts} x {cal.per_host} ranks: nothing to refit")
    cal.overheads = fit_overheads(cal.probes)
    _log_fit(cal, log)
    return cal


def _probe_model(model_toml: Path) -> tuple[list[str], int]:
    """A probe's ``model.toml`` as an entry of ``PROBE_MODELS``: its model's overrides and its micro-batch."""
    layers, width = _gpt_shape(model_toml)
    micro = int(tomllib.loads(model_toml.read_text()).get("train", {}).get("micro_batch_size", 0))
    return [f"gpt.n_layer={layers}", f"gpt.n_embd={width}"], micro


def _gpt_shape(model_toml: Path) -> tuple[int, int]:
    """(layers, width) of the GPT a probe's ``model.toml`` configures: which probe model it is, in any version."""
    gpt = tomllib.loads(model_toml.read_text()).get("gpt", {})
    return int(gpt.get("n_layer", 0)), int(gpt.get("n_embd", 0))
