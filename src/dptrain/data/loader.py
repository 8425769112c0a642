"""Micro-batches for one rank, epoch after epoch, resumable at any optimizer step.

Every rank draws micro-batches of ``micro_batch_size`` from its :class:`DistributedSampler`
shard. An epoch is cut into whole optimizer steps: ``steps_per_epoch`` is the number of
full ``grad_accum_steps`` groups of micro-batches a rank's shard holds, and the rest of
the shard is skipped, so a step never straddles two epochs. Position is then a pure
function of the step count: step s reads epoch ``s // steps_per_epoch``, starting at
global sample ``(s % steps_per_epoch) x global_batch_size`` of that epoch's permutation.
That is all a checkpoint needs to store, and it means the same thing on any world size.
A dataset with a ``set_epoch(epoch)`` method is told each epoch before it is read, as a
sampler is (token files sampled at random offsets draw them per epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dptrain.batching import BatchPlan, BatchSizeError
from dptrain.data.sampler import DistributedSampler

__all__ = ["ShardedLoader", "steps_per_epoch", "set_epoch"]


def set_epoch(dataset: Dataset, epoch: int) -> None:
    """Tell a dataset that draws per epoch (random token windows) which epoch is read, if it has ``set_epoch``."""
    hook = getattr(dataset, "set_epoch", None)
    if callable(hook):
        hook(epoch)


def steps_per_epoch(num_samples: int, plan: BatchPlan) -> int:
    """Whole optimizer steps in one pass over ``num_samples``; a BatchSizeError if none fits."""
    per_rank = num_samples // plan.world_size
    steps = per_rank // (plan.micro_batch_size * plan.grad_accum_steps)
    if steps < 1:
        raise BatchSizeError(
            f"the training set has {num_samples} samples, {per_rank} per rank on {plan.world_size} ranks, "
            f"fewer than one step needs ({plan.micro_batch_size} micro x {plan.grad_accum_steps} accum = "
            f"{plan.micro_batch_size * plan.grad_accum_steps} per rank, global {plan.global_batch_size}); "
            "lower the batch size or use more data")
    return steps


class ShardedLoader:
    def __init__(self, dataset: Dataset, plan: BatchPlan, rank: int, seed: int = 0,
                 collate_fn: Callable | None = None):
        self.dataset, self.plan, self.seed, self.collate_fn = dataset, plan, seed, collate_fn
        self.sampler = DistributedSampler(dataset, num_replicas=plan.world_size, rank=rank, seed=seed,
                                          drop_last=True)
        self.steps_per_epoch = steps_per_epoch(len(dataset), plan)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, global start position) at which optimizer step ``step`` begins."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        return epoch, step_in_epoch * self.plan.global_batch_size

    def micro_batches(self, start_step: int = 0) -> Iterator[Any]:
        """Micro-batches from optimizer step ``start_step`` on, forever."""
        epoch, start = self.position(start_step)
        while True:
            self.sampler.set_epoch(epoch, start=start)
            set_epoch(self.dataset, epoch)
            # A generator of its own: a DataLoader iterator otherwise draws its base seed from
            # the global RNG, which would make the model's random stream (dropout) depend on
            # when iteration started, and a resumed run diverge from an uninterrupted one.
            loader = DataLoader(self.dataset, batch_size=self.plan.micro_batch_size, sampler=self.sampler,
                                drop_last=True, collate_fn=self.collate_fn,
                                generator=torch.Generator().manual_seed(self.seed + epoch))
            remaining = (self.steps_per_epoch - start // self.plan.global_batch_size) * self.plan.grad_accum_steps
            for i, batch in enumerate(loader):
                if i == remaining:
                    break
                yield batch
            epoch, start = epoch + 1, 0
