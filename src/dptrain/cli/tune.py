"""``dptrain tune``: choose the strategy, micro-batch, bucket size and codec for a job, and say why."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import click

from dptrain.cli.input import bad_input, int_list, read_config
from dptrain.tune.probe_length import PROBE_EXTRA, PROBE_ROUNDS, PROBE_SPREAD, PROBE_STEPS, PROBE_WARMUP

__all__ = ["tune"]


@click.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML config of the run to tune")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field (repeatable)")
@click.option("--global-batch", type=int, help="samples per optimizer step over all ranks (default: the config's, "
              "else 32)")
@click.option("--nproc", type=int, help="ranks on this machine")
@click.option("--cluster", "cluster_shape", metavar="HOSTSxPER_HOST",
              help="the emulated cluster instead (dptrain cluster; root), e.g. 2x2")
@click.option("--bandwidth-gbit", type=float, default=1.0, show_default=True,
              help="with --cluster: each host's link rate")
@click.option("--launcher", metavar="COMMAND", help="how a job starts on several machines, '-m MODULE ARGS' appended "
              "(e.g. 'srun python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d "
              "--rdzv-endpoint HOST:29500'); with --hosts and --per-host; files in --out must be shared")
@click.option("--hosts", type=int, help="with --launcher: hosts")
@click.option("--per-host", type=int, help="with --launcher: ranks per host")
@click.option("--strategies", help="strategies to consider, comma-separated (default: every strategy the planner and "
              "the simulator model; name localsgd or diloco to have them predicted and measured apart, never chosen)")
@click.option("--micro-batches", help="micro-batch sizes per rank to consider, comma-separated (default: every "
              "divisor of the samples per rank)")
@click.option("--buckets", default="1,4,25", show_default=True,
              help="bucket sizes (MiB) for the strategies with buckets, comma-separated")
@click.option("--codecs", default="none", show_default=True,
              help="gradient codecs to consider where the strategy all-reduces whole gradients: none, fp16, bf16 "
                   "(those that keep the loss)")
@click.option("--shard-sizes", help="hybrid ZeRO shard sizes to consider (default: every proper divisor of the "
              "world size above 1; 0 for none)")
@click.option("--memory-gib", type=float, help="memory budget per rank: candidates planned above it are not run")
@click.option("--trials", type=int, default=3, show_default=True, help="candidates measured by real runs")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="runs of each measured candidate, interleaved (the median counts)")
@click.option("--max-rounds", type=int, help="the stopping rule's budget: while the best cannot be told from another "
              "candidate, both run again, up to this many runs each  [default: 3, or --rounds if more; with "
              "--exhaustive, --rounds]")
@click.option("--exhaustive", is_flag=True, help="measure every candidate that fits (to check the tuner)")
@click.option("--steps", type=int, default=12, show_default=True, help="steps per trial run")
@click.option("--warmup", type=int, default=4, show_default=True, help="first steps of a trial not timed")
@click.option("--probe-steps", type=int, help=f"steps per calibration probe run, the first {PROBE_WARMUP} not timed  "
              f"[default: {PROBE_STEPS}]")
@click.option("--probe-rounds", type=int, help="runs of each calibration probe, interleaved (the median counts; a "
              f"probe whose runs or steps vary by over {PROBE_SPREAD:.0%} runs again, up to {PROBE_EXTRA} more times)  "
              f"[default: {PROBE_ROUNDS}]")
@click.option("--trial-timeout", type=float, default=600.0, show_default=True,
              help="seconds before a trial counts as hung and is stopped")
@click.option("--calibration", "calibration_path", type=click.Path(path_type=Path),
              help="a calibration measured before on the same machine (OUT/calibration.json); default: measure one")
@click.option("--out", type=click.Path(path_type=Path), default=Path("tune"), show_default=True,
              help="directory for the table, best.toml, the calibration and the trials (must not exist)")
def tune(config_path: Path | None, overrides: tuple[str, ...], global_batch: int | None, nproc: int | None,
         cluster_shape: str | None, bandwidth_gbit: float, launcher: str | None, hosts: int | None,
         per_host: int | None, strategies: str | None, micro_batches: str | None, buckets: str, codecs: str,
         shard_sizes: str | None, memory_gib: float | None, trials: int, rounds: int, max_rounds: int | None,
         exhaustive: bool, steps: int, warmup: int, probe_steps: int | None, probe_rounds: int | None,
         trial_timeout: float, calibration_path: Path | None, out: Path) -> None:
    """Choose the configuration of a job: predicted by the calibrated simulator, confirmed by short runs.

    \b
    dptrain tune --nproc 2                                  # the default run on 2 local ranks
    dptrain tune --config job.toml --nproc 4 --memory-gib 20 --out tune-job
    dptrain tune --cluster 2x2 --bandwidth-gbit 1 --set gpt.n_layer=8   # the emulated cluster (root)
    dptrain tune --nproc 2 --exhaustive                     # measure every candidate

    It enumerates strategy (those the simulator models, and hybrid ZeRO), micro-batch x
    accumulation at the global batch, bucket size and codec; drops what the planner says
    does not fit --memory-gib; ranks the rest by the simulator's step time on this machine's
    calibrated links and overheads; runs the first --trials for --steps steps each; and
    writes OUT/best.toml (for dptrain run --config), the command, and OUT/tune.md, the
    table of every candidate. See docs/tune.md.
    """
    from dptrain.planner.calibration import Calibration, CalibrationError
    from dptrain.strategies import get_strategy, strategy_names
    from dptrain.tune.machine import Emulated, Launcher, Local
    from dptrain.tune.space import candidates
    from dptrain.tune.tuner import TuneOptions

    options = {k: str(v) if isinstance(v, Path) else v for k, v in click.get_current_context().params.items()}
    try:
        chosen = [x for x in (nproc is not None, cluster_shape is not None, launcher is not None) if x]
        if len(chosen) != 1:
            raise click.UsageError("say where the job runs: one of --nproc N, --cluster HOSTSxPER_HOST, --launcher CMD")
        if nproc is not None:
            if nproc < 1:
                raise click.BadParameter(f"--nproc must be at least 1, got {nproc}")
            machine = Local(nproc)
        elif cluster_shape is not None:
            h, _, p = cluster_shape.lower().partition("x")
            if not (h.isdigit() and p.isdigit() and int(h) >= 1 and int(p) >= 1):
                raise click.BadParameter(f"--cluster takes HOSTSxPER_HOST, e.g. 2x2; got {cluster_shape!r}")
            machine = Emulated(int(h), int(p), bandwidth_gbit)
        else:
            if not hosts or not per_host or hosts < 1 or per_host < 1:
                raise click.UsageError("--launcher needs --hosts and --per-host (positive)")
            machine = Launcher(launcher, hosts, per_host)
        if global_batch is not None and global_batch < 1:
            raise click.BadParameter(f"--global-batch must be at least 1 sample, got {global_batch}; leave it out "
                                     "for the config's (else 32)")
        tune_options = TuneOptions(trials, rounds, exhaustive, steps, warmup, trial_timeout, _budget(memory_gib),
                                   max_rounds)
        probes = _probe_options(probe_steps, probe_rounds, calibration_path)
        options["max_rounds"] = tune_options.max_rounds
        _check_out(out)
        extra = list(overrides)
        cfg = read_config(config_path, extra)
        batch = global_batch or cfg.train.global_batch_size or 32
        extra = [*extra, f"train.global_batch_size={batch}"]
        planned = strategy_names(lambda s: s.planned)
        modelled = strategy_names(lambda s: s.planned or s.sync_schedule is not None)
        names = list(planned) if strategies is None else [s.strip() for s in strategies.split(",") if s.strip()]
        for name in names:
            if name not in modelled:
                get_strategy(name)  # an unknown name: the registry's error, with the close ones
                raise click.BadParameter(f"--strategies: {name!r} is not modelled by the simulator; choose among "
                                         f"{', '.join(modelled)}")
        options["strategies"] = ",".join(names)
        space = candidates(machine.world_size, batch, names,
                           int_list(micro_batches, "--micro-batches") if micro_batches else None,
                           _sizes(buckets, "--buckets"),
                           None if shard_sizes is None else [k for k in int_list(shard_sizes, "--shard-sizes") if k],
                           [c.strip() for c in codecs.split(",") if c.strip()])
        calibration = Calibration.load(calibration_path) if calibration_path is not None else None
        if calibration is not None and (calibration.hosts, calibration.per_host) != (machine.hosts, machine.per_host):
            raise click.BadParameter(f"--calibration was measured on {calibration.hosts} x {calibration.per_host} "
                                     f"ranks, this job is {machine.hosts} x {machine.per_host}: measure a new one")
    except click.ClickException as e:  # one line, as the other bad input (docs/tune.md), not click's usage block
        click.echo(f"dptrain tune: {e.message}", err=True)
        sys.exit(2)
    except (CalibrationError, ValueError, *bad_input()) as e:
        click.echo(f"dptrain tune: {e}", err=True)
        sys.exit(2)
    _run(machine, config_path, extra, space, calibration, out, options, tune_options, probes)


def _probe_options(steps: int | None, rounds: int | None, calibration_path: Path | None) -> dict[str, int]:
    """``--probe-steps`` and ``--probe-rounds`` as :func:`~dptrain.tune.calibrate.calibrate`'s keywords (the
    calibration's defaults where left out), or a usage error: too few steps to time one after the warm-up, no
    rounds, or either beside ``--calibration`` (which measures nothing)."""
    if calibration_path is not None and (steps is not None or rounds is not None):
        raise click.UsageError("--probe-steps and --probe-rounds shape a calibration this run measures; with "
                               "--calibration it measures none: leave them out")
    if steps is not None and steps <= PROBE_WARMUP:
        raise click.BadParameter(f"--probe-steps must be more than the {PROBE_WARMUP} warm-up steps, got {steps}; "
                                 f"e.g. --probe-steps {PROBE_WARMUP + 4}")
    if rounds is not None and rounds < 1:
        raise click.BadParameter(f"--probe-rounds must be at least 1, got {rounds}; e.g. --probe-rounds 2")
    return {k: v for k, v in (("steps", steps), ("rounds", rounds)) if v is not None}


def _budget(memory_gib: float | None) -> int | None:
    """``--memory-gib`` in bytes (None: no budget); a positive, finite number of GiB or a usage error."""
    if memory_gib is None:
        return None
    if not 0 < memory_gib < math.inf:
        raise click.BadParameter(f"--memory-gib must be a positive number of GiB per rank, got {memory_gib:g}; "
                                 "e.g. --memory-gib 20, or leave it out for no budget")
    return int(memory_gib * 2**30)


def _sizes(text: str, what: str) -> list[float]:
    """``"1,4,25"`` as positive, finite sizes in MiB, or a usage error naming ``what``."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated sizes in MiB, got {text!r}; e.g. {what} 1,4,25") \
            from None
    if not values or not all(0 < v < math.inf for v in values):
        raise click.BadParameter(f"{what} must be positive sizes in MiB, got {text!r}; e.g. {what} 1,4,25")
    return values


def _check_out(out: Path) -> None:
    """``--out`` is new and can be created: its nearest existing parent is a directory this process can write in
    (tried, as ``dptrain run`` tries its run directory: permission bits do not tell, for root or a read-only mount)."""
    if out.exists():
        raise click.BadParameter(f"--out {out} exists; give a new directory (a tune's files are never mixed "
                                 "with another's)")
    existing = out.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise click.BadParameter(f"--out {out} cannot be created: {existing} is a file, not a directory; give "
                                 "another --out")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise click.BadParameter(f"--out {out} cannot be created in {existing} ({e.strerror}); give another "
                                 "--out") from None


def _failed_on_machine(why: str, kept: Path) -> NoReturn:
    """A measuring job failed on the machine (not bad input): one line, exit 1."""
    click.echo(f"dptrain tune: {why}. What it measured is kept in {kept}; give another --out to try again", err=True)
    sys.exit(1)


def _run(machine, config_path, extra, space, calibration, out: Path, options, opts, probes: dict[str, int]) -> None:
    import time

    from tqdm import tqdm

    from dptrain.tune.calibrate import calibrate, read_profiles
    from dptrain.tune.report import command, tables, write_outputs
    from dptrain.tune.search import TrialFailed
    from dptrain.tune.tuner import profile_request, tune

    out.mkdir(parents=True)
    click.echo(f"dptrain tune: {len(space)} candidates on {machine.where}", err=True)
    t0 = time.perf_counter()
    with machine:
        profiles = None
        if calibration is None:  # the model's profiles measured in the calibration's first job
            click.echo("calibrating the simulator on this machine (links, then probe runs)...", err=True)
            request = profile_request(config_path, extra, space, out)
            try:
                calibration = calibrate(machine, out / "calibration", timeout=opts.timeout, **probes,
                                        log=lambda line: click.echo("  " + line, err=True), models=[request])
            except TrialFailed as e:  # a job that failed on the machine, not bad input: exit 1
                _failed_on_machine(f"the calibration failed: {e}", out / "calibration")
            profiles = read_profiles(request[2])
        calibration.save(out / "calibration.json")
        calibrated = time.perf_counter() - t0
        bar = tqdm(total=None, desc="trials", unit="run", file=sys.stderr, leave=True)

        def progress(row, done, total):
            bar.total = total
            bar.set_postfix_str(f"{row.candidate.label}: {row.status}"
                                + (f" {row.measured_s * 1e3:.0f} ms" if row.measured_s else ""))
            bar.update(done - bar.n)

        try:  # a failed trial is a row of the table; what fails here is the model's own profile job
            tuned = tune(machine, config_path, extra, space, calibration, out, opts, progress, profiles)
        except TrialFailed as e:
            _failed_on_machine(str(e), out)
        finally:
            bar.close()
    tuned.seconds["calibration"] = calibrated
    best_toml = write_outputs(tuned, machine, calibration, config_path, extra, out, options)
    click.echo(tables(tuned.result))
    if best_toml is None:
        click.echo(f"dptrain tune: no candidate ran to the end ({out / 'tune.md'} says why)", err=True)
        sys.exit(1)
    best = tuned.result.best
    click.echo(f"\nchosen: {best.candidate.label}, {best.measured_s * 1e3:.1f} ms per step measured "
               f"({best.predicted_s * 1e3:.1f} predicted); {tuned.result.trials} trial(s), "
               f"{sum(tuned.seconds.values()):.0f} s")
    click.echo(f"config: {best_toml}\nrun it: {command(machine, best_toml, best.candidate.strategy)}")
