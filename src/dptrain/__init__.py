"""dptrain: data-parallel training on torch.distributed.

The public surface a training script needs::

    from dptrain import DistributedDataParallel as DDP   # drop-in for torch's
    from dptrain import DistributedSampler, BatchPlan
    from dptrain import ZeRO                               # sharded: stages 1-3, see docs/zero.md

    # or the whole step (accumulation, clipping, LR schedule, mixed precision), see docs/api.md
    from dptrain import Engine, init_distributed, warmup_cosine
"""

from dptrain.allocator import tune_cpu_allocator
from dptrain.batching import BatchPlan, BatchSizeError
from dptrain.data.sampler import DistributedSampler
from dptrain.ddp import (
    DistributedDataParallel,
    GradBucket,
    NaiveDataParallel,
    ReplicaMismatchError,
    UnusedParametersError,
    allreduce_hook,
)
from dptrain.launch.rendezvous import WorkerEnv, detect_worker_env, init_distributed
from dptrain.train.engine import Engine, StepInfo
from dptrain.train.loader import ShardedLoader
from dptrain.train.schedule import scaled_lr, warmup_cosine
from dptrain.zero import ZeRO

DDP = DistributedDataParallel

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel",
    "DDP",
    "ZeRO",
    "NaiveDataParallel",
    "GradBucket",
    "allreduce_hook",
    "DistributedSampler",
    "BatchPlan",
    "BatchSizeError",
    "ReplicaMismatchError",
    "UnusedParametersError",
    "tune_cpu_allocator",
    "Engine",
    "StepInfo",
    "ShardedLoader",
    "init_distributed",
    "detect_worker_env",
    "WorkerEnv",
    "scaled_lr",
    "warmup_cosine",
]
