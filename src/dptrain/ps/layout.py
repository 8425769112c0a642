"""Who is who in a parameter-server job, and which server owns which parameters.

A job of ``world_size`` ranks with ``num_servers`` servers: the first
``world_size - num_servers`` ranks are workers (rank 0, a worker, writes the run
directory as in every other strategy) and the last ``num_servers`` are servers.

The parameters, in ``model.parameters()`` order, are split into ``num_servers``
contiguous runs of whole tensors with about equal element counts (the greedy linear
partition). A server owns its run of tensors and their optimizer state; a worker keeps
all parameters in one flat buffer, so a server's shard is one contiguous slice of it and
travels as one message. Whole tensors, not arbitrary slices, because the optimizer's
parameter groups (weight decay on matrices only) and layer-wise rules (LARS/LAMB) are
per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Roles", "partition", "PSLayoutError"]


class PSLayoutError(ValueError):
    """A server count or world size that cannot form a parameter-server job."""


@dataclass(frozen=True)
class Roles:
    world_size: int
    num_servers: int

    def __post_init__(self):
        if self.num_servers < 1:
            raise PSLayoutError(f"a parameter-server job needs at least 1 server, got num_servers={self.num_servers}")
        if self.world_size < self.num_servers + 1:
            raise PSLayoutError(f"world size {self.world_size} is too small for {self.num_servers} server(s) plus at "
                                f"least one worker: use at least {self.num_servers + 1} ranks, or fewer servers")

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def workers(self) -> list[int]:
        return list(range(self.num_workers))

    @property
    def servers(self) -> list[int]:
        return list(range(self.num_workers, self.world_size))

    def is_server(self, rank: int) -> bool:
        return rank >= self.num_workers


def partition(numels: list[int], num_servers: int) -> list[range]:
    """Split tensors (by element count, in order) into ``num_servers`` contiguous runs of about equal size.

    Greedy: a run is closed once it reaches the ideal share of what is left, or when
    the tensors left are only enough for one per remaining server.
    """
    if num_servers > len(numels):
        raise PSLayoutError(f"{num_servers} servers for a model of {len(numels)} parameter tensors: a server owns "
                            f"whole tensors, so at most {len(numels)} servers make sense; use fewer servers")
    runs, start, left = [], 0, sum(numels)
    for s in range(num_servers):
        servers_left = num_servers - s
        if servers_left == 1:
            runs.append(range(start, len(numels)))
            break
        target, size, end = left / servers_left, 0, start
        while end < len(numels) - (servers_left - 1) and (end == start or size + numels[end] / 2 <= target):
            size += numels[end]
            end += 1
        runs.append(range(start, end))
        start, left = end, left - size
    return runs
