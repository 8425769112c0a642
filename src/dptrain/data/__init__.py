"""Data for data parallelism: each rank's shard of the dataset."""

from dptrain.data.sampler import DistributedSampler

__all__ = ["DistributedSampler"]
