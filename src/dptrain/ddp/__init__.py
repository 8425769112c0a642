"""The data-parallel engine: bucketed, overlapped DDP and its naive baseline."""

from dptrain.ddp.comm_hooks import GradBucket, allreduce_hook
from dptrain.ddp.errors import NothingToTrainError, NotInitialisedError
from dptrain.ddp.module import DistributedDataParallel
from dptrain.ddp.naive import NaiveDataParallel
from dptrain.ddp.reducer import StepCommStats, UnusedParametersError
from dptrain.ddp.replicas import ReplicaMismatchError

__all__ = [
    "DistributedDataParallel",
    "NaiveDataParallel",
    "GradBucket",
    "allreduce_hook",
    "StepCommStats",
    "UnusedParametersError",
    "ReplicaMismatchError",
    "NothingToTrainError",
    "NotInitialisedError",
]
