"""How a round's workers hold the model: each a whole replica, or a group of them one replica between them.

Every worker takes part in the round's quorum (:mod:`~dptrain.live.quorum`) and votes on
its step; what differs is who averages with whom and who heals whom.

- :class:`WholeReplicas` (data parallelism, local SGD, DiLoCo): each worker holds the whole
  state, the round's members average over one group and a member behind is healed by any
  up-to-date one.
- :class:`ShardGroups` (hybrid sharding): ``k`` consecutive workers (a host's) shard one
  replica between them over a process group of their own (:mod:`~dptrain.live.shard_group`),
  and the workers at the same position of every group hold the same shard. A round takes
  the groups all of whose ``k`` workers are in its quorum; each worker averages its reduced
  shard over the round's workers at its own position (one round group per position), and a
  group behind is healed position by position, each shard from the same position of an
  up-to-date group. A group missing a worker sits the round out; one whose worker is gone
  (stale, or started again) cannot go on at all, since its shards are incomplete: its other
  workers end (:class:`ShardGroupLost`) and their launchers start them again, to be healed
  as a new group (torchft's fault-tolerant HSDP restarts the whole replica group too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dptrain.live.liveness import Liveness
from dptrain.live.quorum import Quorum

__all__ = ["Layout", "WholeReplicas", "ShardGroups", "ShardGroupLost"]


class ShardGroupLost(RuntimeError):
    """A worker of this worker's shard group is gone: the group's shards are incomplete, so this worker ends and is
    started again by its launcher, to be healed with the group's others."""


@dataclass(frozen=True)
class Layout:
    """The round, split for this worker: ``voters`` (every worker of the round: the vote, the data, the records) and
    ``peers`` (those this worker averages with and heals from or to). A split that leaves this worker out of the
    round is None instead."""

    voters: Quorum
    peers: Quorum


class WholeReplicas:
    """Each worker a whole replica: the round's members are both its voters and its peers."""

    group_size = 1
    part = ""  # what a state-hash check names before the hash (live.trust): the whole state

    def split(self, quorum: Quorum, liveness: Liveness) -> Layout:
        return Layout(quorum, quorum)

    def group_prefix(self, round_: int) -> str:
        """The live store's prefix of the round's process group (``live.group.RoundGroup``)."""
        return f"pg/{round_}/"

    def agree(self, ok: bool) -> bool:
        """Whether this worker may take the round's step: its own view."""
        return ok


class ShardGroups:
    """Groups of ``size`` consecutive workers, each group one replica (see the module docstring). ``replica``: this
    worker's id; ``incarnations``: its group's workers' incarnations when the group was formed."""

    def __init__(self, size: int, replica: int, incarnations: tuple[int, ...]):
        self.group_size, self.replica, self.incarnations = size, replica, incarnations
        self.group, self.position = divmod(replica, size)
        self.part = f"{self.position}/"  # a state-hash check compares this position's shards only (live.trust)

    def siblings(self) -> list[int]:
        return [self.group * self.group_size + i for i in range(self.group_size)]

    def split(self, quorum: Quorum, liveness: Liveness) -> Layout | None:
        """The round's whole groups; None when this worker's group is not whole in it (a worker late: the next
        round); :class:`ShardGroupLost` when a worker of its group is gone."""
        self.check_siblings(liveness)
        k = self.group_size
        counts: dict[int, int] = {}
        for m in quorum.members:
            counts[m.replica // k] = counts.get(m.replica // k, 0) + 1
        whole = tuple(m for m in quorum.members if counts[m.replica // k] == k)
        if counts.get(self.group, 0) < k:
            return None
        peers = tuple(m for m in whole if m.replica % k == self.position)
        return Layout(Quorum(quorum.round, whole, _index(whole, self.replica), quorum.absent),
                      Quorum(quorum.round, peers, _index(peers, self.replica), quorum.absent))

    def check_siblings(self, liveness: Liveness) -> None:
        """:class:`ShardGroupLost` when a worker of this group is stale or was started again since it was formed."""
        for sibling, formed in zip(self.siblings(), self.incarnations, strict=True):
            now = liveness.incarnation_of(sibling)
            if sibling != self.replica and (liveness.stale(sibling) or now > formed):
                why = "stopped beating" if liveness.stale(sibling) else f"was started again ({formed} -> {now})"
                raise ShardGroupLost(f"worker {sibling} of this worker's shard group {self.group} {why}: the group's "
                                     "shards are incomplete, so this worker ends to be started again and healed")

    def group_prefix(self, round_: int) -> str:
        """The live store's prefix of the round's process group at this worker's position."""
        return f"pg/{round_}/{self.position}/"

    def agree(self, ok: bool) -> bool:
        """Whether this group takes the round's step, agreed by its workers (collective over the group's own process
        group): every one of them, or none, since each forward and backward is the group's collectives. One
        position's heal can fail while another's succeeds (a peer died mid-heal): the group then sits it out."""
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def _index(members, replica: int) -> int:
    return next(i for i, m in enumerate(members) if m.replica == replica)
