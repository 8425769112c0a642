"""Dynamic batching: move samples of the global batch from slow ranks to fast ones.

Synchronous data parallelism waits for the slowest rank every step. When ranks differ
in speed (a slower device, a busy host), giving rank ``i`` a share ``b_i`` of the
global batch ``B`` proportional to its speed makes them finish together, with the global
batch unchanged. Two things keep the result exact:

- **the same samples**: step ``s`` uses positions ``[s*B, (s+1)*B)`` of the epoch's
  permutation, as the fixed split does (:mod:`dptrain.data.sampler`), and rank ``i``
  takes the contiguous block ``[s*B + b_0 + ... + b_{i-1}, ... + b_i)`` of it;
- **the weighting**: the all-reduce averages the ranks' gradients with equal weights
  ``1/N``, so a micro-batch of ``c`` samples has its mean loss scaled by ``c * N / B``;
  the average is then ``sum over all samples / B``, the global mean, exactly as with
  equal shares.

Speeds are measured before the collective: a rank's forward and backward time less
the communication it waited for (after the all-reduce every rank has waited for the
slowest, so the step time says nothing about who was slow). Every ``every`` steps the
ranks all-gather their smoothed seconds per sample and set new shares proportional to
the inverse, rounded by largest remainder, at least ``minimum`` each. All ranks compute
the same shares from the same gathered numbers, so no rank can disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

from dptrain.data.loader import set_epoch
from dptrain.data.sampler import DistributedSampler

__all__ = ["split_shares", "DynamicBatcher", "DynamicLoader"]


def split_shares(total: int, speeds: list[float], minimum: int = 1) -> list[int]:
    """``total`` split into integers proportional to ``speeds``, each at least ``minimum`` (largest remainder)."""
    n = len(speeds)
    if total < minimum * n:
        raise ValueError(f"a global batch of {total} cannot give {n} ranks at least {minimum} sample(s) each")
    spare = total - minimum * n
    ideal = [spare * s / sum(speeds) for s in speeds]
    shares = [int(x) for x in ideal]
    order = sorted(range(n), key=lambda i: ideal[i] - shares[i], reverse=True)
    for i in order[:spare - sum(shares)]:
        shares[i] += 1
    return [minimum + s for s in shares]


class DynamicBatcher:
    """This step's shares of the global batch, rebalanced every ``every`` steps from measured speeds."""

    def __init__(self, global_batch: int, world_size: int, rank: int, accum: int = 1, every: int = 5,
                 smoothing: float = 0.5, process_group: dist.ProcessGroup | None = None):
        if every < 1:
            raise ValueError(f"every must be >= 1 step, got {every}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.global_batch, self.world_size, self.rank, self.accum = global_batch, world_size, rank, accum
        self.every, self.smoothing, self.group = every, smoothing, process_group
        self.shares = split_shares(global_batch, [1.0] * world_size, minimum=accum)
        self.seconds_per_sample: float | None = None

    @property
    def offset(self) -> int:
        return sum(self.shares[:self.rank])

    def chunks(self) -> list[int]:
        """This rank's share cut into ``accum`` micro-batches (sizes differ by at most one)."""
        q, r = divmod(self.shares[self.rank], self.accum)
        return [q + (k < r) for k in range(self.accum)]

    def weight(self, samples: int) -> float:
        """The factor on a micro-batch's mean loss: ``samples * N / B`` (see the module docstring)."""
        return samples * self.world_size / self.global_batch

    def observe(self, step: int, compute_s: float) -> bool:
        """Record this step's compute time (before the collective); collective every ``every`` steps.

        Returns whether the shares changed.
        """
        per_sample = compute_s / self.shares[self.rank]
        if self.seconds_per_sample is None:
            self.seconds_per_sample = per_sample
        else:
            self.seconds_per_sample = self.smoothing * self.seconds_per_sample + (1 - self.smoothing) * per_sample
        if step % self.every:
            return False
        mine = torch.tensor([self.seconds_per_sample], dtype=torch.float64)
        every_rank = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every_rank, mine, group=self.group)
        speeds = [1.0 / max(float(t), 1e-9) for t in every_rank]
        shares = split_shares(self.global_batch, speeds, minimum=self.accum)
        changed = shares != self.shares
        self.shares = shares
        return changed


class DynamicLoader:
    """This rank's micro-batches under :class:`DynamicBatcher`'s current shares, epoch after epoch."""

    def __init__(self, dataset: Dataset, batcher: DynamicBatcher, steps_per_epoch: int, seed: int = 0,
                 collate_fn: Callable | None = None):
        self.dataset, self.batcher, self.seed = dataset, batcher, seed
        self.steps_per_epoch = steps_per_epoch
        self.collate = collate_fn or default_collate
        self._order = DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed, drop_last=True)

    def steps(self, start_step: int = 0) -> Iterator[list[tuple[Any, float]]]:
        """For each step from ``start_step``: [(micro-batch, loss weight)] for this rank, reading the shares then."""
        step = start_step
        while True:
            epoch, in_epoch = divmod(step, self.steps_per_epoch)
            if epoch != self._order.epoch or step == start_step:
                self._order.set_epoch(epoch)
                set_epoch(self.dataset, epoch)
                order = self._order.permutation()
            begin = in_epoch * self.batcher.global_batch + self.batcher.offset
            micro = []
            for size in self.batcher.chunks():
                micro.append((self.collate([self.dataset[i] for i in order[begin:begin + size]]),
                              self.batcher.weight(size)))
                begin += size
            yield micro
            step += 1
