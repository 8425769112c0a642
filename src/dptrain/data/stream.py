"""The training set as one endless stream of samples, read from any position: live recovery's data order.

Epoch ``e`` is the permutation of the whole set drawn from ``seed + e`` (the one
:class:`~dptrain.data.sampler.DistributedSampler` draws), and the stream is those
permutations end to end; a *position* is how many samples of the stream the run has
consumed. Under live recovery a step of a round of ``k`` workers consumes ``k x micro x
accum`` samples, member ``i`` taking the ``i``-th slice (or, with ``live.global_batch =
"constant"``, the whole global batch, member ``i`` its ``i``-th share), and the position moves on only when
the step commits: a step that aborts is attempted again on the same samples, so no sample
is read twice by committed steps and none is skipped, whatever the rounds' sizes. The
position is part of the state a joining worker is healed with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset, default_collate

from dptrain.data.loader import set_epoch
from dptrain.data.sampler import DistributedSampler

__all__ = ["SampleStream"]


class SampleStream:
    def __init__(self, dataset: Dataset, seed: int = 0, collate_fn: Callable | None = None):
        self.dataset, self.seed = dataset, seed
        self.collate_fn = collate_fn or default_collate
        self.size = len(dataset)
        if self.size < 1:
            raise ValueError("the training set is empty")
        self._epoch, self._order = -1, []

    def indices(self, start: int, count: int) -> list[tuple[int, int]]:
        """(epoch, sample index) of stream positions ``start`` .. ``start + count - 1``."""
        out = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, self.size)
            out.append((epoch, self._permutation(epoch)[offset]))
        return out

    def micro_batches(self, start: int, micro: int, count: int) -> list[Any]:
        """``count`` micro-batches of ``micro`` samples each, from stream position ``start``."""
        batches = []
        for k in range(count):
            samples = []
            for epoch, index in self.indices(start + k * micro, micro):
                set_epoch(self.dataset, epoch)
                samples.append(self.dataset[index])
            batches.append(self.collate_fn(samples))
        return batches

    def consecutive(self, start: int, sizes: list[int]) -> list[Any]:
        """Micro-batches of ``sizes`` samples, one after the other, from stream position ``start``."""
        batches, at = [], start
        for size in sizes:
            batches.extend(self.micro_batches(at, size, 1))
            at += size
        return batches

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:  # the sampler's epoch order, over the whole set
            sampler = DistributedSampler(self.size, num_replicas=1, rank=0, seed=self.seed)
            sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, sampler.permutation()
        return self._order
