"""The ``dptrain`` command line: ``run``, ``prepare-data``, ``plan``, ``simulate``, ``cluster``, ``env``, ``bench``.

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

from dptrain.bench.command import BenchGroup  # no torch: the benchmarks load when run

__all__ = ["main"]

# Every command imports what it needs inside its body: `dptrain --help` and `dptrain CMD --help`
# then never import torch (about a second at each start; tests/test_cli_papercuts.py checks).


def _bad_input() -> tuple[type[Exception], ...]:
    """The errors that mean bad input (one line, exit 2): imported on demand, since they pull in torch."""
    from dptrain.batching import BatchSizeError
    from dptrain.config import ConfigError
    from dptrain.train.checkpoint import CheckpointError

    return ConfigError, BatchSizeError, CheckpointError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dptrain")
def main() -> None:
    """dptrain: data-parallel training on torch.distributed."""


@main.command()
@click.option("--nproc", type=int, default=1, show_default=True, help="worker processes on this machine")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML config file")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config field, e.g. --set train.lr=3e-4 (repeatable)")
@click.option("--run-dir", type=click.Path(path_type=Path), help="run directory (default runs/<task>)")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="restart every worker up to this many times after a failure (torchrun's elastic agent); each "
                   "restart resumes from the newest checkpoint")
@click.option("--fault", metavar="RANK:STEP:KIND",
              help="inject a fault for experiments (kill, kill-in-backward, raise, hang, delay, flip, nan, mismatch); "
                   "the same as DPTRAIN_FAULT (docs/reliability.md)")
@click.option("--start-method", type=click.Choice(["forkserver", "exec"]), default="forkserver", show_default=True,
              help="how local workers start: forks of one process that imported torch once (forkserver), or a "
                   "fresh `python -m dptrain.run` each, as torchrun starts them (exec)")
@click.option("--show-config", is_flag=True, help="print the resolved config as TOML and exit")
@click.option("--config-reference", is_flag=True, help="print every config key, default and meaning (Markdown)")
def run(nproc: int, config_path: Path | None, overrides: tuple[str, ...], run_dir: Path | None,
        max_restarts: int, fault: str | None, start_method: str, show_config: bool, config_reference: bool) -> None:
    """Train on NPROC local workers (gloo on CPU, NCCL on GPUs).

    \b
    dptrain run --nproc 2                                  # byte-level GPT on stdlib source
    dptrain run --nproc 2 --set task.name=classifier       # smoke run, about 20 s
    dptrain run --nproc 4 --config job.toml --set train.lr=1e-3

    A run resumes from its newest checkpoint when started again with the same run
    directory; --max-restarts K does that automatically after a failure, under
    torchrun's elastic agent. On a cluster, start the workers with torchrun instead:
    torchrun --nnodes N --nproc-per-node G ... -m dptrain.run --config job.toml
    """
    from dptrain.config import ConfigError, load_config, to_toml
    from dptrain.data.prepare import prepare, prepare_command
    from dptrain.launch.local import launch_local
    from dptrain.tasks.user import DataNotPrepared
    from dptrain.train.prepare import prepare_run

    if config_reference:
        from dptrain.config.schema import reference_markdown

        click.echo(reference_markdown())
        return
    extra = [f"run_dir={json.dumps(str(run_dir))}"] if run_dir else []
    try:
        if nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {nproc}")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
        if fault:
            _check_fault(fault, nproc)
            os.environ["DPTRAIN_FAULT"] = fault  # the workers inherit it, under either launcher
        cfg = load_config(config_path, list(overrides) + extra)
        if show_config:
            click.echo(to_toml(cfg), nl=False)
            return
        try:
            rp = prepare_run(cfg, nproc)
        except DataNotPrepared as e:  # text or hf data: tokenized once, here, before any worker starts
            click.echo(f"{e.recipe.out} is not prepared yet: preparing it ({prepare_command(e.recipe)})", err=True)
            prepare(e.recipe, progress=sys.stderr.isatty(), log=lambda line: click.echo(line, err=True))
            rp = prepare_run(cfg, nproc)
    except _bad_input() as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    for line in rp.warnings:  # e.g. settings this run never reads
        click.echo(line, err=True)
    worker_args = [a for o in overrides for a in ("--set", o)] + ["--run-dir", str(rp.run_dir)]
    if config_path is not None:
        worker_args = ["--config", str(config_path.resolve())] + worker_args
    if max_restarts:
        from dptrain.launch.elastic import launch_elastic

        sys.exit(launch_elastic(nproc, worker_args, rp.run_dir, max_restarts))
    sys.exit(launch_local(nproc, worker_args, rp.run_dir, cfg.ddp.timeout_s, expendable=_expendable(cfg, nproc),
                          start_method=start_method, roll_call_s=cfg.ddp.roll_call_s,
                          preload=("transformers.modeling_utils",) if cfg.hf.path else ()))


def _check_fault(spec: str, nproc: int) -> None:
    from dptrain.config import ConfigError
    from dptrain.train.faults import fault_spec

    try:
        rank, _, _ = fault_spec(spec)
    except ValueError as e:
        raise ConfigError(f"--fault {e}") from None
    if rank >= nproc:
        raise ConfigError(f"--fault {spec!r}: rank {rank} does not exist with --nproc {nproc}")


def _expendable(cfg, nproc: int) -> set[int]:
    """Ranks whose death the run survives: the workers other than rank 0 of an async, ssp or backup ps job."""
    if cfg.ddp.strategy != "ps" or cfg.ps.mode == "sync":
        return set()
    return set(range(1, nproc - cfg.ps.servers))


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
    from dptrain.config import ConfigError, load_config
    from dptrain.data.prepare import Recipe, prepare, prepared

    try:
        if config_path is not None or overrides:
            if inputs:
                raise ConfigError("give INPUTS or --config, not both")
            cfg = load_config(config_path, list(overrides))
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
    except _bad_input() as e:
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


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{what} must be positive integers, got {text!r}")
    return values


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML config of the run to plan")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field (repeatable)")
@click.option("--params", type=float, help="plan a bare parameter count instead of the config's model "
              "(model states and communication only)")
@click.option("--world-sizes", default="1,2,4,8", show_default=True, help="data-parallel degrees, comma-separated")
@click.option("--strategies", default="ddp,zero1,zero2,zero3", show_default=True,
              help="strategies to plan, comma-separated: ddp, zero1, zero2, zero3 (ZeRO stages, docs/zero.md)")
@click.option("--precisions", default="fp32,bf16", show_default=True,
              help="precisions to plan, comma-separated: fp32, bf16 (mixed precision: DDP under autocast, ZeRO "
                   "with bf16 parameters and fp32 master copies)")
@click.option("--device-memory", type=float, help="GiB per device: adds a 'fits' column")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="write the plan as JSON here")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="write a PNG of memory per rank here")
def plan(config_path: Path | None, overrides: tuple[str, ...], params: float | None, world_sizes: str,
         strategies: str, precisions: str, device_memory: float | None, json_path: Path | None,
         plot_path: Path | None) -> None:
    """Predict per-rank memory and bytes sent per step, before launch.

    \b
    dptrain plan                                   # the default chargpt run
    dptrain plan --set gpt.n_layer=24 --set gpt.n_embd=2048 --device-memory 80
    dptrain plan --params 7e9 --world-sizes 8,64   # a bare parameter count

    Batch rule (plan and simulate): the config's batch as dptrain run resolves it at each
    N. Its global batch (32 if none is given) stays fixed as N grows and each rank takes
    global / N; a world size it cannot be split over is skipped with the reason. Model
    states are exact (the engines' own layout code on a model without storage);
    activations come from a traced forward of one micro-batch; the total adds the
    communication buffers alive in backward. See docs/planner.md.
    """
    from dptrain.config import load_config
    from dptrain.planner import PRECISIONS, STRATEGIES, Setup, plan_row
    from dptrain.planner.from_config import flat_model, plan_config
    from dptrain.planner.report import plot as plot_rows
    from dptrain.planner.report import batch_rule, table, to_json

    sizes = _int_list(world_sizes, "--world-sizes")
    chosen = [s.strip() for s in strategies.split(",") if s.strip()]
    precs = [p.strip() for p in precisions.split(",") if p.strip()]
    for value, allowed, what in ((chosen, STRATEGIES, "--strategies"), (precs, PRECISIONS, "--precisions")):
        unknown = [v for v in value if v not in allowed]
        if unknown or not value:
            raise click.BadParameter(f"{what}: unknown {unknown or value}; choose from {', '.join(allowed)}")
    if device_memory is not None and device_memory <= 0:
        raise click.BadParameter(f"--device-memory must be positive GiB, got {device_memory}")
    notes: list[str] = []
    try:
        if params is not None:
            if params < 1:
                raise click.BadParameter(f"--params must be a positive count, got {params:g}")
            model = flat_model(int(params))
            rows = [plan_row(model, Setup(s, n, p), None, layered=False) for n in sizes for p in precs for s in chosen]
            notes.append("a bare parameter count: activations and communication buffers are not estimated (they "
                         "depend on the layers; plan a model for them); 'fits' compares the model states")
            head = [f"model: a bare parameter count, {int(params):,} parameters"]
        else:
            cfg = load_config(config_path, overrides)
            rows = plan_config(cfg, sizes, chosen, precs, notes)
            head = [f"model: {_model_name(cfg)}", batch_rule("global" if _fixed_global(cfg) else "micro",
                                                             *_batch_sizes(cfg))]
    except _bad_input() as e:
        click.echo(f"dptrain plan: {e}", err=True)
        sys.exit(2)
    if not rows:
        click.echo("dptrain plan: no world size left to plan:\n" + "\n".join(notes), err=True)
        sys.exit(2)
    budget = int(device_memory * 2**30) if device_memory is not None else None
    click.echo("\n".join(head))
    click.echo(table(rows, budget))
    for note in notes:
        click.echo(f"note: {note}")
    if json_path is not None:
        click.echo(f"JSON: {to_json(rows, json_path, {'notes': notes})}")
    if plot_path is not None:
        click.echo(f"plot: {plot_rows(rows, plot_path)}")


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML config of the run to simulate")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field (repeatable)")
@click.option("--strategy", type=click.Choice(["ddp", "zero1", "zero2", "zero3"]), help="default: the config's")
@click.option("--networks", default="loopback,eth-10,eth-100,nvlink4+ib-ndr", show_default=True,
              help="network presets, comma-separated (dptrain simulate --list-networks)")
@click.option("--bandwidth-gbit", type=float, help="a custom network instead: Gbit/s between hosts")
@click.option("--latency-us", type=float, default=50.0, show_default=True, help="with --bandwidth-gbit")
@click.option("--per-node", type=int, default=1, show_default=True, help="with --bandwidth-gbit: workers per host")
@click.option("--node-bandwidth-gbit", type=float,
              help="with --bandwidth-gbit: Gbit/s between the workers of a host (default: the same)")
@click.option("--world-sizes", default="1,2,4,8,16,32,64", show_default=True,
              help="data-parallel degrees to simulate, comma-separated")
@click.option("--algorithm", type=click.Choice(["native", "ring", "tree", "naive", "hierarchical"]), default="native",
              show_default=True, help="native: the backend's own collectives, modelled as rings")
@click.option("--profile", type=click.Choice(["measured", "flops"]), default="measured", show_default=True,
              help="compute times: measured on this machine, or FLOPs at --device-flops")
@click.option("--device-flops", type=float, help="FLOP/s of one device, for --profile flops")
@click.option("--micro-batch", type=int, help="fix the samples per rank instead of the config's global batch "
              "(accumulation 1): N ranks then process N times as many per step")
@click.option("--no-overlap", is_flag=True, help="DDP: launch every bucket when backward ends (no overlap)")
@click.option("--compression", type=int, default=1, show_default=True,
              help="DDP: gradients cross the link this many times smaller (encode/decode not charged)")
@click.option("--json", "json_path", type=click.Path(path_type=Path),
              help="write the simulation as JSON here (every cell, the profile, the networks)")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="PNG: throughput, efficiency, breakdown")
@click.option("--list-networks", is_flag=True, help="print the presets and their sources")
def simulate(config_path, overrides, strategy, networks, bandwidth_gbit, latency_us, per_node, node_bandwidth_gbit,
             world_sizes, algorithm, profile, device_flops, micro_batch, no_overlap, compression, json_path, plot_path,
             list_networks) -> None:
    """Predict step time, throughput and scaling efficiency against the data-parallel degree.

    \b
    dptrain simulate                                        # the default run on the presets
    dptrain simulate --bandwidth-gbit 1 --latency-us 100    # two hosts joined by 1 Gbit/s
    dptrain simulate --set ddp.bucket_cap_mb=100 --networks eth-10
    dptrain simulate --strategy zero3 --set zero.shard_size=8 --networks eth-100   # HSDP, a host per shard group

    Batch rule (plan and simulate): the config's batch as dptrain run resolves it at each
    N. Its global batch (32 if none is given) stays fixed as N grows and each rank takes
    global / N (strong scaling); --micro-batch fixes the samples per rank instead (weak
    scaling). A world size the batch cannot be split over is skipped with the reason.
    The backward pass is replayed bucket by bucket on the network's links with the
    collectives' cost model. --profile measured times this machine: for GPU networks
    give --profile flops --device-flops. See docs/simulator.md.
    """
    from dptrain.config import load_config
    from dptrain.planner.from_config import simulate_config
    from dptrain.planner.network import PRESETS, Network, custom_link, network
    from dptrain.planner.report import batch_rule, plot_scaling, scaling_table, skip_lines

    if list_networks:
        for net in PRESETS.values():
            click.echo(f"{net.name}: node {net.node.beta * 8 / 1e9:g} Gbit/s, net {net.net.beta * 8 / 1e9:g} Gbit/s, "
                       f"{net.per_node if net.per_node < 1 << 20 else 'all'} per node. {net.source}")
        return
    sizes = _int_list(world_sizes, "--world-sizes")
    if micro_batch is not None and micro_batch < 1:
        raise click.BadParameter(f"--micro-batch must be positive, got {micro_batch}")
    try:
        if bandwidth_gbit is not None:
            if per_node < 1:
                raise click.BadParameter(f"--per-node must be positive, got {per_node}")
            link = custom_link(bandwidth_gbit, latency_us * 1e-6)
            node = link if node_bandwidth_gbit is None else custom_link(node_bandwidth_gbit, latency_us * 1e-6)
            nets = [Network(f"{bandwidth_gbit:g}Gbit", node, link, per_node,
                            f"custom: {bandwidth_gbit:g} Gbit/s, {latency_us:g} us")]
        else:
            nets = [network(name.strip()) for name in networks.split(",") if name.strip()]
        cfg = load_config(config_path, overrides)
        result = simulate_config(cfg, sizes, strategy or cfg.ddp.strategy, nets, algorithm, profile, micro_batch,
                                 device_flops, overlap=not no_overlap, compression=compression)
    except (ValueError, *_bad_input()) as e:
        click.echo(f"dptrain simulate: {e}", err=True)
        sys.exit(2)
    if not result["batches"]:
        click.echo("dptrain simulate: no world size left to simulate:\n" + "\n".join(skip_lines(result["skipped"])),
                   err=True)
        sys.exit(2)
    first = result["batches"][min(result["batches"])]
    click.echo(f"model: {_model_name(cfg)}")
    click.echo(batch_rule(result["fixed"], first.global_batch_size, first.micro_batch_size))
    if profile == "measured" and any(_gpu_class(net) for net in nets):
        click.echo(f"warning: --profile measured replays this machine's compute ({_this_device()}) over GPU-class "
                   f"links ({', '.join(net.name for net in nets if _gpu_class(net))}); for a GPU cluster give "
                   "--profile flops --device-flops F, e.g. 4e14 for an H100 reaching 40% of its 989e12 dense "
                   "bf16 FLOP/s", err=True)
    for micro, prof in result["profiles"].items():
        click.echo(f"compute per micro-batch of {micro}: forward {prof.forward_s * 1e3:.1f} ms, "
                   f"backward {prof.backward_s * 1e3:.1f} ms, optimizer {prof.optimizer_s * 1e3:.1f} ms "
                   f"({prof.source})")
    click.echo(scaling_table(result))
    for line in skip_lines(result["skipped"]):
        click.echo(line)
    if json_path is not None:
        from dptrain.planner.report import scaling_json

        click.echo(f"JSON: {scaling_json(result, json_path)}")
    if plot_path is not None:
        click.echo(f"plot: {plot_scaling(result, plot_path)}")


def _model_name(cfg) -> str:
    """What a config trains, in a few words: the task, and the user's factory or Hugging Face path if any."""
    if cfg.hf.path:
        return f"the Hugging Face model in {cfg.hf.path} (task {cfg.task.name})"
    if cfg.task.model:
        return f"{cfg.task.model} (the factory of task.model, task {cfg.task.name})"
    if cfg.task.name == "chargpt":
        g = cfg.gpt
        return f"task chargpt: a GPT of {g.n_layer} blocks, width {g.n_embd}, {g.block_size} tokens per sample"
    return f"task {cfg.task.name}'s built-in model"


def _batch_sizes(cfg) -> tuple[int | None, int | None]:
    """The global and micro batch at world size 1, as the batch rule line quotes them."""
    from dptrain.batching import BatchPlan

    t = cfg.train
    sizes = (t.global_batch_size, t.micro_batch_size, t.grad_accum_steps)
    batch = BatchPlan.resolve(1, *(sizes if any(v is not None for v in sizes) else (32, None, None)))
    return batch.global_batch_size, batch.micro_batch_size


def _fixed_global(cfg) -> bool:
    """Whether the config's batch keeps the global batch fixed over world sizes (it does unless only micro is set)."""
    t = cfg.train
    return t.global_batch_size is not None or t.micro_batch_size is None


def _gpu_class(net) -> bool:
    """Whether a network is a GPU cluster's: the presets with NVLink inside a host (all but loopback)."""
    return "nvlink" in f"{net.name} {net.source}".lower()


def _this_device() -> str:
    import platform

    return f"{platform.processor() or platform.machine()} CPU, one thread"


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="TOML config whose model joins the presets (default: the built-in run's)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field (repeatable)")
@click.option("-o", "--out", "out", type=click.Path(path_type=Path), default=Path("explore.html"), show_default=True,
              help="the HTML file to write")
@click.option("--models", default="config,gpt2-124m,gpt2-355m,gpt2-774m,gpt2-1.5b,7b,70b", show_default=True,
              help="models to offer, comma-separated: config (the config's model) and presets")
@click.option("--micro-batches", default="1,4", show_default=True,
              help="micro-batch sizes the memory panel offers (each costs a traced forward per model)")
def explore(config_path: Path | None, overrides: tuple[str, ...], out: Path, models: str, micro_batches: str) -> None:
    """Write one self-contained HTML page to explore memory, scaling and all-reduce interactively.

    \b
    dptrain explore                          # explore.html: the built-in run's model and the presets
    dptrain explore --config job.toml -o job.html
    dptrain explore --models config,7b,70b   # fewer models, a faster build

    The ZeRO memory, DP scaling and all-reduce panels show what dptrain plan, dptrain
    simulate and the collectives' cost model compute, over DP degrees 1 to 1024; the page
    needs no network and no server. See docs/explore.md.
    """
    from dptrain.config import load_config
    from dptrain.pages.explore import write_explore
    from dptrain.pages.explore_data import PRESET_MODELS

    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m != "config" and m not in PRESET_MODELS]
    if unknown or not names:
        raise click.BadParameter(f"unknown model(s) {unknown or names}; choose from config, {', '.join(PRESET_MODELS)}",
                                 param_hint="--models")
    sizes = tuple(_int_list(micro_batches, "--micro-batches"))
    try:
        cfg = load_config(config_path, overrides)
        path = write_explore(out, cfg=cfg, models=names, micro_batches=sizes,
                             progress=lambda line: click.echo(f"explore: {line}", err=True))
    except (ValueError, *_bad_input()) as e:
        click.echo(f"dptrain explore: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): open it in a browser")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--hosts", type=int, default=2, show_default=True, help="emulated hosts (network namespaces)")
@click.option("--per-host", type=int, default=1, show_default=True, help="workers per host (torchrun's nproc)")
@click.option("--bandwidth-gbit", type=float, default=1.0, show_default=True,
              help="each host's link rate, both directions (tc tbf)")
@click.option("--queue-latency-ms", type=float, default=50.0, show_default=True,
              help="how long a packet may wait in a link's queue (tbf latency; not a propagation delay)")
@click.option("--timeout", type=float, help="stop the job after this many seconds (exit 124)")
@click.option("--port", type=int, default=29400, show_default=True, help="rendezvous port on host 0")
@click.option("--cleanup", is_flag=True, help="only remove namespaces left by a killed dptrain cluster")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def cluster(hosts: int, per_host: int, bandwidth_gbit: float, queue_latency_ms: float, timeout: float | None,
            port: int, cleanup: bool, args: tuple[str, ...]) -> None:
    """Run a torchrun job on an emulated multi-host cluster with rate-limited links (needs root).

    \b
    dptrain cluster --hosts 2 --bandwidth-gbit 1 -- -m dptrain.run --set train.steps=20
    dptrain cluster --hosts 4 --per-host 2 --bandwidth-gbit 5 -- my_train.py --lr 1e-3

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
        network = Network(hosts, rate_mbit=bandwidth_gbit * 1000, queue_latency_ms=queue_latency_ms)
        click.echo(f"dptrain cluster: {hosts} hosts x {per_host} workers, {bandwidth_gbit:g} Gbit/s links "
                   f"(namespaces {network.host(0)}..)", err=True)
        with network:
            code = run_on_cluster(network, per_host, list(args), port=port, timeout=timeout)
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


if __name__ == "__main__":
    main()
