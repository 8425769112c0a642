"""dptrain: data-parallel training on torch.distributed.

The public surface a training script needs::

    from dptrain import DistributedDataParallel as DDP   # drop-in for torch's
    from dptrain import DistributedSampler, BatchPlan
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

DDP = DistributedDataParallel

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel",
    "DDP",
    "NaiveDataParallel",
    "GradBucket",
    "allreduce_hook",
    "DistributedSampler",
    "BatchPlan",
    "BatchSizeError",
    "ReplicaMismatchError",
    "UnusedParametersError",
    "tune_cpu_allocator",
]
