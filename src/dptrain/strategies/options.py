"""A strategy's wrapper options from a run's config: ``[ddp]``, ``[zero]``, ``[gossip]`` unpacked once.

The wrappers take explicit keyword arguments and never read the config; the job runner,
the planner and the benchmarks turn a config into those arguments here, so a setting means
the same thing wherever it is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptrain.optim.build import decays

__all__ = ["ddp_options", "zero_options", "gossip_options"]


def ddp_options(cfg, model: nn.Module, nodes: int) -> dict[str, Any]:
    """:class:`~dptrain.ddp.DistributedDataParallel`'s arguments from ``[ddp]``."""
    d = cfg.ddp
    return dict(bucket_cap_mb=d.bucket_cap_mb, last_bucket_cap_mb=d.last_bucket_cap_mb,
                gradient_as_bucket_view=d.gradient_as_bucket_view,
                find_unused_parameters=d.find_unused_parameters, static_graph=d.static_graph,
                algorithm=d.algorithm, nodes=nodes, check_collectives=d.check_collectives,
                check_timeout_s=d.timeout_s)


def gossip_options(cfg, model: nn.Module, nodes: int) -> dict[str, Any]:
    """:class:`~dptrain.gossip.GossipDataParallel`'s arguments from ``[gossip]``."""
    return dict(topology=cfg.gossip.topology)


def zero_options(cfg, model: nn.Module, nodes: int, stage: int) -> dict[str, Any]:
    """:class:`~dptrain.zero.ZeRO`'s arguments from ``[ddp]`` and ``[zero]``; unit class names resolved
    against ``model``. Stage 3 gathers parameters per unit, so it has units where 1-2 have buckets."""
    z = cfg.zero
    kwargs: dict[str, Any] = dict(algorithm=cfg.ddp.algorithm, nodes=nodes, split_by=decays,
                                  reduce_dtype=torch.bfloat16 if z.reduce_dtype == "bf16" else torch.float32,
                                  check_collectives=cfg.ddp.check_collectives, check_timeout_s=cfg.ddp.timeout_s,
                                  find_unused_parameters=cfg.ddp.find_unused_parameters,
                                  shard_size=z.shard_size or None)
    if stage < 3:
        if cfg.ddp.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = cfg.ddp.bucket_cap_mb
        return kwargs
    kwargs.update(reshard_after_forward=z.reshard_after_forward, prefetch=z.prefetch)
    classes = {type(m).__name__: type(m) for m in model.modules()}
    if z.unit_classes:
        unknown = [name for name in z.unit_classes if name not in classes]
        if unknown:
            raise ValueError(f"zero.unit_classes {unknown} do not occur in the model; its module classes are "
                             f"{sorted(classes)}")
        kwargs["unit_classes"] = tuple(classes[name] for name in z.unit_classes)
    elif z.min_unit_numel:
        kwargs["min_unit_numel"] = z.min_unit_numel
    else:  # the blocks of the first ModuleList (a transformer's layers), else about 8 units by size
        blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)), None)
        if blocks is not None:
            kwargs["unit_classes"] = tuple({type(b) for b in blocks})
        else:
            kwargs["min_unit_numel"] = max(1, sum(p.numel() for p in model.parameters()) // 8)
    return kwargs
