"""dptrain: data-parallel training on torch.distributed.

The public surface a training script needs::

    from dptrain import DistributedDataParallel as DDP   # drop-in for torch's
    from dptrain import DistributedSampler, BatchPlan
    from dptrain import ZeRO                               # sharded: stages 1-3, see docs/zero.md

    # or the whole step (accumulation, clipping, LR schedule, mixed precision), see docs/api.md
    from dptrain import Engine, init_distributed, warmup_cosine

    # or an Accelerate-style loop: prepare(model, optimizer, loader, scheduler), see docs/api.md
    from dptrain import prepare

    # live recovery in your own loop (dptrain launch --live-restarts N): for r in Live(model, optimizer, ...)
    from dptrain import Live

Every name is imported on first use (PEP 562 ``__getattr__``): ``import dptrain`` and the
command line's ``--help`` do not import torch, which takes about a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it (its own name there, unless given after a colon)
_EXPORTS = {
    "DistributedDataParallel": "dptrain.ddp",
    "DDP": "dptrain.ddp:DistributedDataParallel",
    "ZeRO": "dptrain.zero",
    "NaiveDataParallel": "dptrain.ddp",
    "GradBucket": "dptrain.ddp",
    "allreduce_hook": "dptrain.ddp",
    "DistributedSampler": "dptrain.data.sampler",
    "BatchPlan": "dptrain.batching",
    "BatchSizeError": "dptrain.batching",
    "ReplicaMismatchError": "dptrain.ddp",
    "UnusedParametersError": "dptrain.ddp",
    "tune_cpu_allocator": "dptrain.allocator",
    "Engine": "dptrain.api.engine",
    "StepInfo": "dptrain.api.engine",
    "prepare": "dptrain.api.prepare",
    "scheduler_steps_per_epoch": "dptrain.api.prepare",
    "PreparedModel": "dptrain.api.prepared_model",
    "Live": "dptrain.api.live",
    "Round": "dptrain.api.live",
    "get_state_dict": "dptrain.api.full_state",
    "set_state_dict": "dptrain.api.full_state",
    "unwrap_model": "dptrain.api.full_state",
    "end_training": "dptrain.api.full_state",
    "ShardedLoader": "dptrain.data.loader",
    "init_distributed": "dptrain.launch.rendezvous",
    "leave_process_groups": "dptrain.launch.rendezvous",
    "detect_worker_env": "dptrain.launch.rendezvous",
    "WorkerEnv": "dptrain.launch.rendezvous",
    "scaled_lr": "dptrain.optim.schedule",
    "warmup_cosine": "dptrain.optim.schedule",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Import an exported name from its module on first access, then keep it in this module."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dptrain' has no attribute {name!r}")
    module, _, attr = _EXPORTS[name].partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from dptrain.allocator import tune_cpu_allocator
    from dptrain.api.engine import Engine, StepInfo
    from dptrain.api.full_state import end_training, get_state_dict, set_state_dict, unwrap_model
    from dptrain.api.live import Live, Round
    from dptrain.api.prepare import prepare, scheduler_steps_per_epoch
    from dptrain.api.prepared_model import PreparedModel
    from dptrain.batching import BatchPlan, BatchSizeError
    from dptrain.data.loader import ShardedLoader
    from dptrain.data.sampler import DistributedSampler
    from dptrain.ddp import (
        DistributedDataParallel,
        GradBucket,
        NaiveDataParallel,
        ReplicaMismatchError,
        UnusedParametersError,
        allreduce_hook,
    )
    from dptrain.launch.rendezvous import WorkerEnv, detect_worker_env, init_distributed, leave_process_groups
    from dptrain.optim.schedule import scaled_lr, warmup_cosine
    from dptrain.zero import ZeRO

    DDP = DistributedDataParallel
