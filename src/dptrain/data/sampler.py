"""Each rank's disjoint shard of a dataset, reshuffled each epoch identically on every rank.

Every rank draws the same permutation of the dataset from a generator seeded with
``seed + epoch``, so no communication is needed to agree on it, and rank ``r`` of ``N``
takes positions ``r, r + N, r + 2N, ...`` of it. Because the assignment is strided, after
each rank has taken ``k`` samples the ranks together have consumed exactly the first
``k * N`` positions of the permutation. That makes the position in an epoch a single
number independent of the world size: :meth:`DistributedSampler.set_epoch` takes a
``start`` position, and a run checkpointed on N ranks can resume on M ranks with no
sample skipped or seen twice.

When the dataset size is not a multiple of ``N``:

- ``drop_last=True`` drops the tail of the permutation: every rank gets
  ``len // N`` samples and ``len % N`` samples are not seen this epoch (a different
  tail each epoch when shuffling);
- ``drop_last=False`` (the default, as in torch) pads the permutation by repeating its
  beginning: every rank gets ``ceil(len / N)`` samples and ``N - len % N`` samples are
  seen twice this epoch.

Arguments mirror ``torch.utils.data.distributed.DistributedSampler``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["DistributedSampler"]


class DistributedSampler(Sampler[int]):
    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        # Defaults read the default process group, as torch's sampler does; pass both
        # explicitly when the data-parallel group is not the world.
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas}): need 0 <= rank < num_replicas")
        self.dataset_size = dataset if isinstance(dataset, int) else len(dataset)
        if self.dataset_size < 1:
            raise ValueError("the dataset is empty: there is nothing to shard")
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if drop_last and self.dataset_size < num_replicas:
            raise ValueError(f"drop_last=True with {self.dataset_size} samples and {num_replicas} "
                             "ranks leaves every rank empty; use drop_last=False or fewer ranks")
        self.epoch = 0
        self.start = 0

    @property
    def total_size(self) -> int:
        """Positions in the epoch's (truncated or padded) permutation, over all ranks."""
        n, world = self.dataset_size, self.num_replicas
        return (n // world) * world if self.drop_last else math.ceil(n / world) * world

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation; begin at global position ``start`` within it.

        ``start`` is the number of samples all ranks together have already consumed in
        this epoch (e.g. ``steps_done * global_batch_size``), valid on any world size.
        """
        if not 0 <= start <= self.total_size:
            raise ValueError(f"start {start} is outside this epoch's {self.total_size} positions")
        if start % self.num_replicas:
            # Ranks would get different numbers of samples, and a synchronous loop hangs
            # on the step only some of them take.
            raise ValueError(f"start {start} is not a multiple of num_replicas {self.num_replicas}; "
                             f"resume at a multiple of the global batch (e.g. "
                             f"{start - start % self.num_replicas})")
        self.epoch = epoch
        self.start = start

    def permutation(self) -> list[int]:
        """The epoch's global order of sample indices, identical on every rank."""
        n = self.dataset_size
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        total = self.total_size
        if total <= n:
            return order[:total]
        repeats = math.ceil((total - n) / n)
        return order + (order * repeats)[: total - n]

    def __iter__(self) -> Iterator[int]:
        return iter(self.permutation()[self.start + self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self.total_size, self.num_replicas))
