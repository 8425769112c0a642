"""The registry entries' functions for the strategies that came first: a run's config unpacked once.

The wrappers take explicit keyword arguments and never read the config; the job runner,
the planner and the benchmarks turn a config into those arguments here (``*_options``),
so a setting means the same thing wherever it is read. Beside them, what each of these
strategies alone checks and applies: ZeRO's hybrid shard size and its compressed
reduce-scatter, the DDP engine's compression hook, the parameter server's layout, model,
checkpoints and expendable workers. And the planner's view of the DDP engine and ZeRO
(``*_units``): their communication units laid out by the engines' own grouping code, so
the planner imports no strategy's package. (A newer strategy keeps these with its entry:
``registry.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch
from torch import nn

from dptrain.compress import make_codec
from dptrain.compress.remedies import Remedies
from dptrain.optim.build import decays

__all__ = ["ddp_options", "zero_options", "gossip_options", "compression_remedies", "ddp_compression",
           "zero_compression", "zero_check", "zero_check_live", "zero_check_shards", "zero_check_model", "ps_check", "ps_check_model", "ps_check_resume",
           "ps_expendable", "ps_program", "LaidOut", "ddp_units", "zero_units", "SyncSchedule"]


def ddp_options(cfg, model: nn.Module, nodes: int) -> dict[str, Any]:
    """:class:`~dptrain.ddp.DistributedDataParallel`'s arguments from ``[ddp]``."""
    d, job = cfg.ddp, cfg.distributed
    return dict(bucket_cap_mb=d.bucket_cap_mb, last_bucket_cap_mb=d.last_bucket_cap_mb,
                gradient_as_bucket_view=d.gradient_as_bucket_view,
                find_unused_parameters=d.find_unused_parameters, static_graph=d.static_graph,
                algorithm=d.algorithm, nodes=nodes, check_collectives=job.check_collectives,
                check_timeout_s=job.timeout_s)


def gossip_options(cfg, model: nn.Module, nodes: int) -> dict[str, Any]:
    """:class:`~dptrain.gossip.GossipDataParallel`'s arguments from ``[gossip]``."""
    return dict(topology=cfg.gossip.topology)


def zero_options(cfg, model: nn.Module, nodes: int, stage: int) -> dict[str, Any]:
    """:class:`~dptrain.zero.ZeRO`'s arguments from ``[ddp]``, ``[distributed]``, ``[compression]`` and ``[zero]``; unit class names resolved
    against ``model``. Stage 3 gathers parameters per unit, so it has units where 1-2 have buckets."""
    z = cfg.zero
    kwargs: dict[str, Any] = dict(algorithm=cfg.ddp.algorithm, nodes=nodes, split_by=decays,
                                  reduce_dtype=torch.bfloat16 if z.reduce_dtype == "bf16" else torch.float32,
                                  check_collectives=cfg.distributed.check_collectives,
                                  check_timeout_s=cfg.distributed.timeout_s,
                                  find_unused_parameters=cfg.ddp.find_unused_parameters,
                                  shard_size=z.shard_size or None)
    if cfg.compression.method != "none":  # its reduce-scatter compresses shard by shard
        from dptrain.compress.zero import ShardedCompression

        kwargs["compression"] = ShardedCompression(make_codec(cfg.compression.method), cfg.compression.error_feedback)
    if stage < 3:
        if cfg.ddp.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = cfg.ddp.bucket_cap_mb
        return kwargs
    kwargs.update(reshard_after_forward=z.reshard_after_forward, prefetch=z.prefetch)
    if z.unit_classes:
        kwargs["unit_classes"] = _unit_classes(z.unit_classes, model)
    elif z.min_unit_numel:
        kwargs["min_unit_numel"] = z.min_unit_numel
    else:  # the blocks of the first ModuleList (a transformer's layers), else about 8 units by size
        blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)), None)
        if blocks is not None:
            kwargs["unit_classes"] = tuple({type(b) for b in blocks})
        else:
            kwargs["min_unit_numel"] = max(1, sum(p.numel() for p in model.parameters()) // 8)
    return kwargs


def _unit_classes(names: list[str], model: nn.Module) -> tuple[type, ...]:
    """``zero.unit_classes``: the model's module classes of these names; a ValueError naming the ones it has."""
    classes = {type(m).__name__: type(m) for m in model.modules()}
    unknown = [name for name in names if name not in classes]
    if unknown:
        raise ValueError(f"zero.unit_classes {unknown} do not occur in the model; its module classes are "
                         f"{sorted(classes)}")
    return tuple(classes[name] for name in names)


def zero_check_model(cfg, model: nn.Module) -> None:
    """Before launch: ``zero.unit_classes`` name module classes of the model (stage 3 gathers by them)."""
    if cfg.zero.unit_classes:
        _unit_classes(cfg.zero.unit_classes, model)


def compression_remedies(cfg) -> Remedies:
    """``[compression]``'s corrections and schedules for top-k and PowerSGD (:mod:`dptrain.compress.remedies`)."""
    d = cfg.compression
    return Remedies(momentum=cfg.train.momentum if d.momentum_correction else None, masking=d.momentum_masking,
                    local_clip=d.local_clip, topk_warmup_steps=d.topk_warmup_steps,
                    powersgd_uncompressed_steps=d.powersgd_uncompressed_steps,
                    powersgd_warmup_rank=d.powersgd_warmup_rank, powersgd_warmup_steps=d.powersgd_warmup_steps)


def ddp_compression(cfg, wrapper: nn.Module) -> Any:
    """``compression.method`` as a communication hook on the DDP engine's buckets (None: uncompressed); under live
    recovery the round's compressed mean, which the live gate registers with the round's group."""
    d = cfg.compression
    if d.method == "none":
        return None
    from dptrain.compress.hook import CompressionHook

    codec = make_codec(d.method, topk_fraction=d.topk_fraction, powersgd_rank=d.powersgd_rank)
    if cfg.live.enabled:
        from dptrain.compress.round_hook import RoundCompression

        return RoundCompression(codec, error_feedback=d.error_feedback)
    hook = CompressionHook(codec, error_feedback=d.error_feedback, remedies=compression_remedies(cfg))
    wrapper.register_comm_hook(None, hook)
    return hook


def zero_compression(cfg, wrapper: nn.Module) -> Any:
    """ZeRO's compressed reduce-scatter, built with the wrapper (:func:`zero_options`); None uncompressed."""
    return wrapper.compression if cfg.compression.method != "none" else None


def zero_check(cfg, world_size: int) -> int:
    """``zero.shard_size`` (hybrid sharding) divides the world; every rank takes data."""
    if cfg.zero.shard_size:
        try:
            zero_check_shards(cfg.zero.shard_size, world_size)
        except ValueError as e:
            raise ValueError(f"zero.{e}, or 0 to shard over all ranks") from None
    return world_size


def zero_check_live(cfg, world_size: int) -> None:
    """Live recovery serves ZeRO's replica dimension: hybrid sharding's groups of ``zero.shard_size`` workers, each
    group one replica (:mod:`dptrain.live.layout`); a round averages each shard over the whole groups in it."""
    shard = cfg.zero.shard_size
    if not shard or shard >= world_size:
        raise ValueError(f"live.enabled with zero.shard_size = {shard} over {world_size} workers: sharded over every "
                         "worker, the model has no replica to go on with when one is lost. Set zero.shard_size to "
                         f"the workers per host (a divisor of {world_size} below it: hybrid sharding, each group a "
                         "replica that live recovery drops and heals whole), or live.enabled = false")
    if cfg.compression.method != "none":
        raise ValueError(f"live.enabled with strategy {cfg.distributed.strategy} and compression.method = "
                         f"{cfg.compression.method!r}: ZeRO's compressed reduce-scatter is not run over live recovery's "
                         "rounds; set compression.method = \"none\", or live.enabled = false")


def zero_check_shards(shard_size: int, world_size: int) -> None:
    """Hybrid sharding's groups of ``shard_size`` ranks tile the world
    (:func:`dptrain.zero.hybrid.check_shard_size`)."""
    from dptrain.zero.hybrid import check_shard_size

    check_shard_size(shard_size, world_size)


class SyncSchedule(NamedTuple):
    """What a strategy whose replicas step alone reduces when they meet (the registry's ``sync_schedule``): a sync
    point every ``every`` steps, each reducing the next of ``parts`` (elements; one part: the whole model every time;
    Streaming DiLoCo's fragments in turn) as ``wire_bytes(n)`` bytes a payload, beside ``overlap`` steps of compute;
    the first ``warmup_steps`` steps synchronous (DDP's); ``name``: what a sync point is called."""

    every: int
    parts: tuple[int, ...]
    overlap: int
    wire_bytes: Callable[[int], int]
    warmup_steps: int
    name: str


class LaidOut(NamedTuple):
    """One communication unit as the engine would build it, for the planner (its ``Unit``, field for field)."""

    numel: int
    dtype: torch.dtype
    resharded: bool  # freed after forward and gathered again in backward (ZeRO-3's unit modules)
    names: tuple[str, ...]  # its parameters' qualified names


def ddp_units(model: nn.Module, *, bucket_cap_mb: float | None = None, last_bucket_cap_mb: float | None = None,
              **others: Any) -> list[LaidOut]:
    """The DDP engine's buckets for ``model`` (any device, meta included), by its own rule
    (:func:`dptrain.ddp.buckets.ddp_bucket_layout`). ``others``: the other engines' options, which do not apply."""
    from dptrain.ddp.buckets import ParamInfo, ddp_bucket_layout

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    infos = [ParamInfo(p.numel(), p.element_size(), p.dtype, p.device) for _, p in named]
    return [LaidOut(sum(named[i][1].numel() for i in b), named[b[0]][1].dtype, False, tuple(named[i][0] for i in b))
            for b in ddp_bucket_layout(infos, bucket_cap_mb, last_bucket_cap_mb)]


def zero_units(stage: int) -> Callable[..., list[LaidOut]]:
    """ZeRO's flat units for ``model`` at ``stage``, by its own grouping (:mod:`dptrain.zero.grouping`): stages
    1-2 bucket the parameters (``bucket_cap_mb``; None: ZeRO's default), stage 3 makes a unit per unit module
    (``unit_classes`` or ``min_unit_numel``) plus the root; ``split_by(name, tensor)`` keeps keys apart;
    ``others``: the other engines' options, which do not apply."""
    def units(model: nn.Module, *, bucket_cap_mb: float | None = None, unit_classes: tuple[type, ...] = (),
              min_unit_numel: int | None = None, reshard_after_forward: bool = True,
              split_by: Callable[[str, torch.Tensor], Hashable] | None = None, **others: Any) -> list[LaidOut]:
        from dptrain.zero.grouping import bucket_groups, collect_params, module_groups
        from dptrain.zero.policy import UnitPolicy

        refs, _ = collect_params(model)

        def key(ref):
            return split_by(ref.name, ref.tensor) if split_by is not None else None

        if stage < 3:
            cap = UnitPolicy.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb
            groups = bucket_groups(refs, cap, torch.device("meta"), key)
        else:
            groups = module_groups(model, refs, tuple(unit_classes), min_unit_numel, key)
        return [LaidOut(sum(r.numel for r in members), members[0].tensor.dtype,
                        stage == 3 and reshard_after_forward and owner is not None, tuple(r.name for r in members))
                for owner, members in groups]
    return units


def ps_check(cfg, world_size: int) -> int:
    """The parameter-server settings; returns the number of workers (the ranks that take data)."""
    from dptrain.ps.consistency import Consistency
    from dptrain.ps.layout import Roles

    p = cfg.ps
    try:
        roles = Roles(world_size, p.servers)
        Consistency(p.mode, staleness=p.staleness, backups=p.backups).check_workers(roles.num_workers)
    except ValueError as e:
        raise ValueError(f"[ps] servers={p.servers}, mode={p.mode!r}: {e}") from None
    if cfg.train.precision == "fp16":
        raise ValueError("train.precision fp16 is not supported with strategy ps (it needs a loss scaler); use bf16")
    servers = range(world_size - p.servers, world_size)
    if cfg.straggler.rank in servers:
        raise ValueError(f"straggler.rank {cfg.straggler.rank} is a parameter server (ranks {servers.start}-"
                         f"{servers.stop - 1}); a straggler must be a worker, a rank below {servers.start}")
    if p.lookahead and p.mode not in ("async", "ssp"):
        raise ValueError(f"ps.lookahead is for modes async and ssp; in mode {p.mode!r} every applied gradient is "
                         "fresh, so there is nothing to look ahead for: set lookahead = false")
    if p.lookahead and cfg.train.optimizer not in ("adamw", "adam", "sgd"):
        raise ValueError(f"ps.lookahead predicts the optimizer's next step, which dptrain does for adamw, adam and "
                         f"sgd, not {cfg.train.optimizer!r}: change train.optimizer or set lookahead = false")
    return roles.num_workers


def ps_check_model(cfg, model: nn.Module) -> None:
    """The servers can split the parameters into ``ps.servers`` shards of whole tensors."""
    from dptrain.ps.layout import partition

    try:
        partition([p.numel() for p in model.parameters()], cfg.ps.servers)
    except ValueError as e:
        raise ValueError(f"ps.servers={cfg.ps.servers}: {e}") from None


def ps_check_resume(path, meta: dict, cfg, world_size: int) -> None:
    """A ps checkpoint resumes only on the layout it was saved with (:func:`dptrain.checkpoint.ps.check_ps_resume`)."""
    from dptrain.checkpoint.ps import check_ps_resume

    check_ps_resume(path, meta, cfg.ps.servers, cfg.ps.mode, world_size)


def ps_expendable(cfg, world_size: int) -> set[int]:
    """The workers other than rank 0 of an async, ssp or backup job: the run goes on without them."""
    return set() if cfg.ps.mode == "sync" else set(range(1, world_size - cfg.ps.servers))


def ps_program(ctx: Any) -> Any:
    """The parameter server's own program (its ranks run two: :func:`dptrain.ps.program.train_ps`)."""
    from dptrain.ps.program import train_ps

    return train_ps(ctx)
