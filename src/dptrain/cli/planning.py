"""The planning commands: ``dptrain plan``, ``simulate`` and ``explore`` (memory, step time, the interactive page).

Each imports the planner inside its body, so ``dptrain --help`` stays free of torch; for
the same reason the strategies they take are not listed in the help but checked in the
body against the planner's (``dptrain.planner.STRATEGIES``, the registry's planned
entries), an unknown one named with a did-you-mean. ``dptrain.cli`` registers them on
the ``dptrain`` group.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from dptrain.cli.input import bad_input, int_list, read_config

__all__ = ["plan", "simulate", "explore", "check_params"]


@click.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML config of the run to plan")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field (repeatable)")
@click.option("--params", type=float, help="plan a bare parameter count instead of the config's model "
              "(model states and communication only)")
@click.option("--world-sizes", default="1,2,4,8", show_default=True, help="data-parallel degrees, comma-separated")
@click.option("--strategies", help="strategies to plan, comma-separated (default: every strategy the planner models; "
              "docs/planner.md)")
@click.option("--precisions", default="fp32,bf16", show_default=True,
              help="precisions to plan, comma-separated: fp32, bf16 (mixed precision: DDP under autocast, ZeRO "
                   "with bf16 parameters and fp32 master copies)")
@click.option("--device-memory", metavar="GIB|DEVICE",
              help="the device's memory, in GiB or a device's name (h100, a100-80gb, h200, a10): adds a 'fits' column")
@click.option("--headroom", type=float,
              help="with --device-memory: the share of the device kept free for what the plan does not count (the "
                   "CUDA context, NCCL's buffers, fragmentation; default 0.1, i.e. 10%); 'fits' compares the total "
                   "with the rest")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="write the plan as JSON here")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="write a PNG of memory per rank here")
def plan(config_path: Path | None, overrides: tuple[str, ...], params: float | None, world_sizes: str,
         strategies: str | None, precisions: str, device_memory: str | None, headroom: float | None,
         json_path: Path | None, plot_path: Path | None) -> None:
    """Predict per-rank memory and bytes sent per step, before launch.

    \b
    dptrain plan                                   # the default chargpt run
    dptrain plan --set gpt.n_layer=24 --set gpt.n_embd=2048 --device-memory h100
    dptrain plan --set hf.path=DIR --device-memory 80   # a Hugging Face model: its config.json is enough
    dptrain plan --params 7e9 --world-sizes 8,64   # a bare parameter count

    Batch rule (plan and simulate): the config's batch as dptrain run resolves it at each
    N. Its global batch (32 if none is given) stays fixed as N grows and each rank takes
    global / N; a world size it cannot be split over is skipped with the reason. Model
    states are exact (the engines' own layout code on a model without storage);
    activations come from a traced forward of one micro-batch; the total adds the
    communication buffers alive in backward. 'fits' keeps --headroom of the device free.
    See docs/planner.md.
    """
    from dptrain.planner import PRECISIONS, STRATEGIES
    from dptrain.planner.devices import DEFAULT_HEADROOM, budget_line, check_headroom, device_bytes
    from dptrain.planner.from_config import plan_config, plan_count
    from dptrain.planner.report import batch_rule, table, to_json
    from dptrain.planner.report import plot as plot_rows
    from dptrain.planner.target import plan_target
    from dptrain.strategies.registry import did_you_mean

    sizes = int_list(world_sizes, "--world-sizes")
    chosen = list(STRATEGIES) if strategies is None else [s.strip() for s in strategies.split(",") if s.strip()]
    precs = [p.strip() for p in precisions.split(",") if p.strip()]
    for value, allowed, what in ((chosen, STRATEGIES, "--strategies"), (precs, PRECISIONS, "--precisions")):
        unknown = [v for v in value if v not in allowed]
        if unknown or not value:
            hint = did_you_mean(unknown[0], allowed) if unknown else ""
            raise click.BadParameter(f"{what}: unknown {unknown or value}{hint}; choose from {', '.join(allowed)}")
    headroom = DEFAULT_HEADROOM if headroom is None else headroom
    try:
        budget = device_bytes(device_memory) if device_memory is not None else None
        check_headroom(headroom)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    notes: list[str] = []
    try:
        if params is not None:
            check_params(params)
            rows = plan_count(int(params), sizes, chosen, precs)
            notes.append("a bare parameter count: one tensor that ZeRO-3 reshards as a transformer's blocks (a real "
                         "model's embeddings and head are gathered once: its ZeRO-3 bytes are a little lower); "
                         "activations and communication buffers are not estimated (they depend on the layers; plan "
                         "a model for them); 'fits' compares the model states")
            head = [f"model: a bare parameter count, {int(params):,} parameters"]
        else:
            cfg = read_config(config_path, overrides)
            target = plan_target(cfg)
            rows = plan_config(cfg, sizes, chosen, precs, notes, target)
            notes = target.notes + notes
            head = [f"model: {_model_name(cfg)}",
                    batch_rule("global" if _fixed_global(cfg) else "micro", *_batch_sizes(cfg)), target.heading()]
    except bad_input() as e:
        click.echo(f"dptrain plan: {e}", err=True)
        sys.exit(2)
    if not rows:
        click.echo("dptrain plan: no world size left to plan:\n" + "\n".join(notes), err=True)
        sys.exit(2)
    click.echo("\n".join(head))
    click.echo(table(rows, budget, headroom))
    if budget is not None:
        notes.append(budget_line(budget, headroom))
    for note in notes:
        click.echo(f"note: {note}")
    if json_path is not None:
        device = {"device_memory_bytes": budget, "headroom": headroom} if budget is not None else {}
        click.echo(f"JSON: {to_json(rows, json_path, {'notes': notes, **device})}")
    if plot_path is not None:
        click.echo(f"plot: {plot_rows(rows, plot_path)}")


MAX_PARAMS = 1e15  # a thousand times the largest dense models trained; beyond, a typo (1e30) or a unit slip


def check_params(params: float) -> None:
    """``--params``: a whole, finite count in [1, MAX_PARAMS], or a usage error (exit 2) saying what to give."""
    if not (math.isfinite(params) and 1 <= params <= MAX_PARAMS and params == int(params)):
        raise click.BadParameter(f"--params must be a positive count: a whole parameter count from 1 to {MAX_PARAMS:.0e}, got "
                                 f"{params:g}; e.g. --params 7e9 for a 7B model")


@click.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML config of the run to simulate")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a config field (repeatable)")
@click.option("--strategy", help="a strategy the planner models (default: the config's distributed.strategy; an unknown one "
              "lists them)")
@click.option("--networks", default="loopback,eth-10,eth-100,nvlink4+ib-ndr", show_default=True,
              help="network presets, comma-separated (dptrain simulate --list-networks)")
@click.option("--bandwidth-gbit", type=float, help="a custom network instead: Gbit/s between hosts")
@click.option("--latency-us", type=float, default=50.0, show_default=True, help="with --bandwidth-gbit")
@click.option("--per-node", type=int, default=1, show_default=True, help="with --bandwidth-gbit: workers per host")
@click.option("--node-bandwidth-gbit", type=float,
              help="with --bandwidth-gbit: Gbit/s between the workers of a host (default: the same)")
@click.option("--calibration", "calibration_path", type=click.Path(path_type=Path),
              help="a machine's calibration (dptrain tune's OUT/calibration.json): its fitted links and overheads "
                   "instead of --networks (docs/tune.md)")
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
             calibration_path, world_sizes, algorithm, profile, device_flops, micro_batch, no_overlap, compression, json_path, plot_path,
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
    from dptrain.planner import STRATEGIES
    from dptrain.planner.from_config import simulate_config
    from dptrain.planner.network import PRESETS, Network, custom_link, network
    from dptrain.planner.report import batch_rule, plot_scaling, scaling_table, skip_lines
    from dptrain.strategies import get_strategy

    if list_networks:
        for net in PRESETS.values():
            click.echo(f"{net.name}: node {net.node.beta * 8 / 1e9:g} Gbit/s, net {net.net.beta * 8 / 1e9:g} Gbit/s, "
                       f"{net.per_node if net.per_node < 1 << 20 else 'all'} per node. {net.source}")
        return
    sizes = int_list(world_sizes, "--world-sizes")
    if micro_batch is not None and micro_batch < 1:
        raise click.BadParameter(f"--micro-batch must be positive, got {micro_batch}")
    overheads = None
    try:
        if calibration_path is not None:
            from dptrain.planner.calibration import Calibration

            calibration = Calibration.load(calibration_path)
            nets, overheads = [calibration.network()], calibration.overheads
        elif bandwidth_gbit is not None:
            if per_node < 1:
                raise click.BadParameter(f"--per-node must be positive, got {per_node}")
            link = custom_link(bandwidth_gbit, latency_us * 1e-6)
            node = link if node_bandwidth_gbit is None else custom_link(node_bandwidth_gbit, latency_us * 1e-6)
            nets = [Network(f"{bandwidth_gbit:g}Gbit", node, link, per_node,
                            f"custom: {bandwidth_gbit:g} Gbit/s, {latency_us:g} us")]
        else:
            nets = [network(name.strip()) for name in networks.split(",") if name.strip()]
        cfg = read_config(config_path, overrides)
        strategy = strategy or cfg.distributed.strategy
        get_strategy(strategy, among=STRATEGIES)  # before the model is built and timed
        result = simulate_config(cfg, sizes, strategy, nets, algorithm, profile, micro_batch,
                                 device_flops, overlap=not no_overlap, compression=compression, overheads=overheads)
    except (ValueError, *bad_input()) as e:
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
        data = f" on data.source {cfg.data.source}" if cfg.data.source != "task" else ""
        return f"the Hugging Face model in {cfg.hf.path}{data}"
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


@click.command()
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
    from dptrain.pages.explore import write_explore
    from dptrain.pages.explore_data import PRESET_MODELS

    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m != "config" and m not in PRESET_MODELS]
    if unknown or not names:
        raise click.BadParameter(f"unknown model(s) {unknown or names}; choose from config, {', '.join(PRESET_MODELS)}",
                                 param_hint="--models")
    sizes = tuple(int_list(micro_batches, "--micro-batches"))
    try:
        cfg = read_config(config_path, overrides)
        path = write_explore(out, cfg=cfg, models=names, micro_batches=sizes,
                             progress=lambda line: click.echo(f"explore: {line}", err=True))
    except (ValueError, *bad_input()) as e:
        click.echo(f"dptrain explore: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): open it in a browser")
