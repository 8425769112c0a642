"""The ``dptrain`` command line: ``run``, ``prepare-data``, ``cluster``, ``env``, ``bench``; ``launch``
from :mod:`dptrain.cli.launch`; ``consolidate`` from :mod:`dptrain.cli.checkpoint`; ``plan``,
``simulate`` and ``explore`` from :mod:`dptrain.cli.planning`.

``dptrain run`` checks everything a run needs (config, batch sizes, model factory,
checkpoint) before it starts a worker or creates the run directory: bad input is one
clear error and exit code 2, with nothing written. Then it starts ``--nproc`` workers on
this machine (``launch.local``), each of which is what ``torchrun -m dptrain.run`` would
start on a cluster.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from dptrain.cli.bench_group import BenchGroup  # no torch: the benchmarks load when run
from dptrain.cli.checkpoint import consolidate
from dptrain.cli.input import bad_input, read_config
from dptrain.cli.launch import launch
from dptrain.cli.planning import explore, plan, simulate
from dptrain.cli.tune import tune
from dptrain.utils.collector import freeze_at_exit

__all__ = ["main"]

# Every command imports what it needs inside its body: `dptrain --help` and `dptrain CMD --help`
# then never import torch (about a second at each start; tests/test_cli_papercuts.py checks).


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dptrain")
def main() -> None:
    """dptrain: data-parallel training on torch.distributed."""
    freeze_at_exit()  # the command's exit walks none of what it imported: 0.8 s less (dptrain.utils.collector)


@main.command()
@click.option("--nproc", type=int, default=1, show_default=True, help="worker processes on this machine")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML config file")
@click.option("--strategy", metavar="NAME", help="the data-parallel strategy: ddp, zero1, zero2, zero3, localsgd, "
              "diloco, ps, gossip (--config-reference lists them); the same as --set distributed.strategy=NAME")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config field, e.g. --set train.lr=3e-4 (repeatable)")
@click.option("--run-dir", type=click.Path(path_type=Path), help="run directory (default runs/<task>)")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="restart every worker up to this many times after a failure (torchrun's elastic agent); each "
                   "restart resumes from the newest checkpoint")
@click.option("--fault", metavar="RANK:STEP:KIND",
              # dptrain.runner.faults.KINDS, written out: importing it would import torch for --help
              # (tests/test_trust_values.py checks that this list and docs/run.md's name every kind)
              help="inject a fault for experiments (kill, kill-in-backward, raise, hang, delay, flip, nan, mismatch, "
                   "stop, kill-before-vote, kill-in-heal); the same as DPTRAIN_FAULT (docs/reliability.md)")
@click.option("--start-method", type=click.Choice(["forkserver", "exec"]), default="forkserver", show_default=True,
              help="how local workers start: forks of one process that imported torch once (forkserver), or a "
                   "fresh `python -m dptrain.run` each, as torchrun starts them (exec)")
@click.option("--show-config", is_flag=True, help="print the resolved config as TOML and exit")
@click.option("--config-reference", is_flag=True, help="print every config key, default and meaning (Markdown)")
def run(nproc: int, config_path: Path | None, strategy: str | None, overrides: tuple[str, ...], run_dir: Path | None,
        max_restarts: int, fault: str | None, start_method: str, show_config: bool, config_reference: bool) -> None:
    """Train on NPROC local workers (gloo on CPU, NCCL on GPUs).

    \b
    dptrain run --nproc 2                                  # byte-level GPT on stdlib source
    dptrain run --nproc 2 --set task.name=classifier       # smoke run, about 20 s
    dptrain run --nproc 2 --strategy zero2                 # ZeRO stage 2
    dptrain run --nproc 4 --config job.toml --set train.lr=1e-3

    A run resumes from its newest checkpoint when started again with the same run
    directory; --max-restarts K does that automatically after a failure, under
    torchrun's elastic agent. On a cluster, start the workers with torchrun instead:
    torchrun --nnodes N --nproc-per-node G ... -m dptrain.run --config job.toml
    """
    from dptrain.utils.collector import collector_paused

    with collector_paused():  # torch and the checks, imported for less CPU (dptrain.utils.collector)
        import torch._dynamo  # noqa: F401  the model's check on the meta device imports it anyway: here, inside the pause

        from dptrain.config import ConfigError, to_toml
        from dptrain.data.prepare import prepare, prepare_command
        from dptrain.launch.run_lock import RunDirError, acquire
        from dptrain.runner.validate import default_run_dir, validate_run
        from dptrain.tasks.user import DataNotPrepared

    if config_reference:
        from dptrain.config.schema import reference_markdown
        from dptrain.strategies import REGISTRY

        click.echo(reference_markdown())
        click.echo("\n**distributed.strategy** (`--strategy`), the registered strategies\n\n| name | what it is |\n|---|---|")
        for name, entry in REGISTRY.items():
            click.echo(f"| `{name}` | {entry.summary} |")
        return
    extra = [f"run_dir={json.dumps(str(run_dir))}"] if run_dir else []
    lock = None  # the run directory's (launch.run_lock), held until the workers exit
    try:
        if nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {nproc}")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
        overrides = _with_strategy(strategy, overrides)
        if fault:
            _check_fault(fault, nproc)
            os.environ["DPTRAIN_FAULT"] = fault  # the workers inherit it, under either launcher
        cfg = read_config(config_path, list(overrides) + extra)
        if show_config:
            click.echo(to_toml(cfg), nl=False)
            return
        target = default_run_dir(cfg).resolve()  # an existing one is locked before its checkpoints are read
        lock = acquire(target, "dptrain run", log=_note) if target.is_dir() else None
        try:
            rp = validate_run(cfg, nproc)
        except DataNotPrepared as e:  # text or hf data: tokenized once, here, before any worker starts
            click.echo(f"{e.recipe.out} is not prepared yet: preparing it ({prepare_command(e.recipe)})", err=True)
            prepare(e.recipe, progress=sys.stderr.isatty(), log=_note)
            rp = validate_run(cfg, nproc)
        lock = lock or acquire(rp.run_dir, "dptrain run", log=_note)  # a new one: once the input is known good
    except (*bad_input(), RunDirError) as e:
        _release(lock, undo=True)  # nothing written: the lock file as it was
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except BaseException:
        _release(lock, undo=True)
        raise
    try:
        code = _launch(rp, cfg, nproc, config_path, overrides, max_restarts, start_method, lock)
    finally:
        lock.release()  # the workers have exited (a test suite runs many runs in one process)
    sys.exit(code)


def _with_strategy(strategy: str | None, overrides: tuple[str, ...]) -> tuple[str, ...]:
    """``--strategy NAME`` as the override it stands for (the workers get it so too); both ways at once is an error."""
    from dptrain.config import ConfigError
    from dptrain.config.loader import parse_override
    from dptrain.config.renamed import renamed_key

    if strategy is None:
        return overrides
    given = [o for o in overrides if renamed_key(parse_override(o)[0], "")[0] == "distributed.strategy"]
    if given:
        raise ConfigError(f"--strategy {strategy} and --set {given[0]} both choose the strategy: give one")
    return (f"distributed.strategy={json.dumps(strategy)}", *overrides)


def _note(line: str) -> None:
    click.echo(line, err=True)


def _release(lock, undo: bool) -> None:
    if lock is not None:
        lock.release(undo)


def _launch(rp, cfg, nproc: int, config_path: Path | None, overrides: tuple[str, ...], max_restarts: int,
            start_method: str, lock) -> int:
    """Start the workers, under this launcher or torchrun's agent (``--max-restarts``); their exit code.

    Every process started holds the run directory's lock with us (``lock.fd``, ``launch.run_lock``)."""
    from dptrain.launch.local import launch_local
    from dptrain.launch.run_lock import TOKEN_ENV
    from dptrain.launch.threads import omp_warning

    for line in [*rp.warnings, omp_warning(os.environ)]:  # e.g. settings this run never reads
        if line:
            click.echo(line, err=True)
    worker_args = [a for o in overrides for a in ("--set", o)] + ["--run-dir", str(rp.run_dir)]
    if config_path is not None:
        worker_args = ["--config", str(config_path.resolve())] + worker_args
    preload = ("transformers.modeling_utils",) if cfg.hf.path else ()
    if cfg.live.enabled:  # a failed worker is restarted alone; the others go on, meeting at a store served here
        from dptrain.launch.local import RestartFailed
        from dptrain.live.store import LIVE_STORE_ENV, serve_store

        live = cfg.live
        store = serve_store("127.0.0.1", 0)  # held until the workers are done: it outlives every one of them
        return launch_local(nproc, worker_args, rp.run_dir, max(2 * live.heartbeat_timeout_s, 5.0),
                            start_method=start_method, preload=preload, lock_fd=lock.fd,
                            env={LIVE_STORE_ENV: f"127.0.0.1:{store.port}"},
                            restart=RestartFailed(live.max_restarts, 2 * live.heartbeat_timeout_s + 5.0))
    if max_restarts:  # torchrun's workers are not "local": they find this launcher's token and take no lock
        from dptrain.launch.elastic import launch_elastic

        return launch_elastic(nproc, worker_args, rp.run_dir, max_restarts, env={TOKEN_ENV: lock.token},
                              lock_fd=lock.fd, timeout_s=cfg.distributed.timeout_s)
    return launch_local(nproc, worker_args, rp.run_dir, cfg.distributed.timeout_s, expendable=_expendable(cfg, nproc),
                        start_method=start_method, roll_call_s=cfg.distributed.roll_call_s, preload=preload,
                        lock_fd=lock.fd)


def _check_fault(spec: str, nproc: int) -> None:
    from dptrain.config import ConfigError
    from dptrain.runner.faults import fault_spec

    try:
        rank, _, _ = fault_spec(spec)
    except ValueError as e:
        raise ConfigError(f"--fault {e}") from None
    if rank >= nproc:
        raise ConfigError(f"--fault {spec!r}: rank {rank} does not exist with --nproc {nproc}")


def _expendable(cfg, nproc: int) -> set[int]:
    """Ranks whose death the run survives, as the strategy says (the parameter server's workers, in its async modes)."""
    from dptrain.strategies import get_strategy

    entry = get_strategy(cfg.distributed.strategy)
    return entry.expendable(cfg, nproc) if entry.expendable is not None else set()


@main.command("prepare-data")
@click.argument("inputs", nargs=-1)
@click.option("--out", type=click.Path(path_type=Path), help="the token directory to write (train.bin, val.bin, "
              "meta.json); default data/<name of the first input>")
@click.option("--tokenizer", default="bytes", show_default=True,
              help="bytes, or the path of a Hugging Face tokenizer.json (nothing is downloaded)")
@click.option("--val", "val_inputs", multiple=True, help="a file (directory, glob) held out for validation "
              "(repeatable); default: the tail of the tokens, --val-fraction")
@click.option("--val-fraction", type=float, default=0.05, show_default=True,
              help="without --val: the share of the tokens, at the end, held out for validation")
@click.option("--hf", "hf_files", is_flag=True, help="INPUTS are data files read by Hugging Face datasets "
              "(.jsonl, .json, .parquet, .csv, .arrow); their --text-column is the text")
@click.option("--text-column", default="text", show_default=True,
              help="with --hf: the column holding the text")
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="prepare what a run config's [data] section names instead (data.source text or hf)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="with --config: override a field")
def prepare_data(inputs: tuple[str, ...], out: Path | None, tokenizer: str, val_inputs: tuple[str, ...],
                 val_fraction: float, hf_files: bool, text_column: str, config_path: Path | None,
                 overrides: tuple[str, ...]) -> None:
    """Tokenize text (files, directories, globs) or local data files into train.bin and val.bin, once.

    \b
    dptrain prepare-data books/ --out data/books                       # bytes: vocabulary 256
    dptrain prepare-data corpus.txt --tokenizer tokenizer.json          # a Hugging Face tokenizer file
    dptrain prepare-data train.jsonl --hf --text-column text --val val.jsonl
    dptrain prepare-data --config job.toml                              # what the run's [data] names

    Then train on them: dptrain run --set data.source=tokens --set data.dir=<out>
    (docs/your-data.md). dptrain run on data.source text or hf prepares them itself.
    """
    from dptrain.config import ConfigError
    from dptrain.data.prepare import Recipe, prepare, prepared

    try:
        if config_path is not None or overrides:
            if inputs:
                raise ConfigError("give INPUTS or --config, not both")
            cfg = read_config(config_path, list(overrides))
            if cfg.data.source not in ("text", "hf"):
                raise ConfigError(f"data.source is {cfg.data.source!r}: prepare-data prepares sources text and hf")
            recipe = Recipe.from_config(cfg.data)
        else:
            source = "hf" if hf_files else "text"
            recipe = Recipe(source, tuple(inputs), out or Path(_default_out(inputs)), tokenizer, tuple(val_inputs),
                            val_fraction, text_column)
        done = prepared(recipe)  # a ConfigError if the directory holds something else
        if done is not None:
            click.echo(f"already prepared: {done.dir} ({done.tokens('train.bin'):,} train and "
                       f"{done.tokens('val.bin'):,} validation tokens, vocabulary {done.vocab_size:,})")
            return
        prepare(recipe, progress=sys.stderr.isatty(), log=click.echo)
    except bad_input() as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def _default_out(inputs: tuple[str, ...]) -> str:
    from dptrain.config import ConfigError
    from dptrain.data.prepare import default_dir

    out = default_dir(inputs)
    if not out:
        raise ConfigError("no INPUTS: give the text files (directories, globs) to prepare, or --config")
    return out


@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def env(as_json: bool) -> None:
    """Versions, distributed backends, cores and devices (paste into bug reports)."""
    from dptrain.envinfo import collect_env, format_env

    info = collect_env()
    click.echo(json.dumps(info, indent=2) if as_json else format_env(info))


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--hosts", type=int, default=2, show_default=True, help="emulated hosts (network namespaces)")
@click.option("--per-host", type=int, default=1, show_default=True, help="workers per host (torchrun's nproc)")
@click.option("--bandwidth-gbit", type=float, default=1.0, show_default=True,
              help="each host's link rate, both directions (tc tbf)")
@click.option("--queue-latency-ms", type=float, default=50.0, show_default=True,
              help="how long a packet may wait in a link's queue (tbf latency; not a propagation delay)")
@click.option("--timeout", type=float, help="stop the job after this many seconds (exit 124)")
@click.option("--port", type=int, default=29400, show_default=True, help="rendezvous port on host 0")
@click.option("--live-restarts", type=int, default=None,
              help="a live-recovery job (run it with --set live.enabled=true): the live store on host 0, each host's "
                   "worker under a torchrun of its own, restarted alone up to this many times while the others go on")
@click.option("--cleanup", is_flag=True, help="only remove namespaces left by a killed dptrain cluster")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def cluster(hosts: int, per_host: int, bandwidth_gbit: float, queue_latency_ms: float, timeout: float | None,
            port: int, live_restarts: int | None, cleanup: bool, args: tuple[str, ...]) -> None:
    """Run a torchrun job on an emulated multi-host cluster with rate-limited links (needs root).

    \b
    dptrain cluster --hosts 2 --bandwidth-gbit 1 -- -m dptrain.run --set train.steps=20
    dptrain cluster --hosts 4 --per-host 2 --bandwidth-gbit 5 -- my_train.py --lr 1e-3
    dptrain cluster --hosts 4 --live-restarts 100 -- -m dptrain.run --strategy diloco --set live.enabled=true

    ARGS are what torchrun runs (a script or -m module, and its arguments). Each host is
    a network namespace on a bridge, its link limited by tc's token bucket in both
    directions; each runs a torchrun agent, with a real c10d rendezvous on host 0.
    Everything is torn down at the end, on failure and on Ctrl-C. See docs/cluster.md.
    """
    from dptrain.cluster import Network, NetworkError, check_root, cleanup_stale, run_on_cluster

    try:
        check_root()
        if cleanup:
            removed = cleanup_stale()
            click.echo(f"removed {len(removed)} namespace(s): {', '.join(removed) or '-'}")
            return
        if not args:
            raise click.UsageError("give the job to run after --, e.g. dptrain cluster -- -m dptrain.run")
        if per_host < 1:
            raise ValueError(f"--per-host must be at least 1, got {per_host}")
        if live_restarts is not None and (live_restarts < 0 or per_host != 1):
            raise ValueError(f"--live-restarts needs a count >= 0 (got {live_restarts}) and one worker per host "
                             f"(--per-host 1, got {per_host}): each host's worker is a replica of its own")
        network = Network(hosts, rate_mbit=bandwidth_gbit * 1000, queue_latency_ms=queue_latency_ms)
        click.echo(f"dptrain cluster: {hosts} hosts x {per_host} workers, {bandwidth_gbit:g} Gbit/s links "
                   f"(namespaces {network.host(0)}..)", err=True)
        with network:
            code = run_on_cluster(network, per_host, list(args), port=port, timeout=timeout,
                                  live_restarts=live_restarts)
    except (NetworkError, ValueError) as e:
        click.echo(f"dptrain cluster: {e}", err=True)
        sys.exit(2)
    sys.exit(code)


@main.group(cls=BenchGroup)
def bench() -> None:
    """Run a benchmark: variants measured side by side in one run, results under bench_results/.

    \b
    dptrain bench ddp --caps 1 25 --rounds 10     # each benchmark's options: dptrain bench NAME --help
    dptrain bench comm --world-size 2
    python -m dptrain.bench.ddp --rounds 10       # the same command, as a module

    Benchmarks are not tests: they print ratios and write JSON. See docs/benchmarks.md.
    """


for _command in (launch, consolidate, plan, simulate, explore, tune):
    main.add_command(_command)

if __name__ == "__main__":
    main()
