"""A shard group under live recovery: ``k`` workers that hold one replica between them, met through the live store.

Hybrid sharding (:mod:`dptrain.zero.hybrid`) shards a replica over ``k`` consecutive workers.
Under live recovery no process group spans the job, but a shard group's workers run
collectives on every forward and backward, so each group gets a process group of its own,
made before the model is built: the worker's default group, ``k`` ranks over the live store.

A group is formed by one *generation* of its workers. Each start of a worker is an
incarnation (``inc/<replica>``, :mod:`~dptrain.live.liveness`); a group is formed by
incarnations all newer than those of the last group formed (``sg/<g>/formed``), and its
store keys are named by them (``sg/<g>/<i0>-<i1>-.../``), so a worker started again meets
only workers also started since the group broke: a survivor of the old group ends when it
sees a worker of its group gone (:class:`~dptrain.live.layout.ShardGroupLost`), and its
launcher starts it again. A group that cannot be formed within ``start_timeout_s`` (a worker
of it never returns) gives up (:class:`~dptrain.live.quorum.TooFewWorkers`); the other
groups go on.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from dptrain.live.layout import ShardGroups
from dptrain.live.liveness import incarnation_key
from dptrain.live.quorum import TooFewWorkers

__all__ = ["join_shard_group", "formed_key"]

POLL_S = 0.05


def formed_key(group: int) -> str:
    return f"sg/{group}/formed"


def join_shard_group(store, replica: int, size: int, *, start_timeout_s: float,
                     timeout_s: float) -> tuple[ShardGroups, int]:
    """This worker's start: its incarnation taken, its group's generation awaited, the default process group made
    over it (``timeout_s``: its collectives' timeout); the layout, and this worker's incarnation."""
    group, position = divmod(replica, size)
    siblings = [group * size + i for i in range(size)]
    incarnation = int(store.add(incarnation_key(replica), 1))
    formed = json.loads(store.get(formed_key(group))) if store.check([formed_key(group)]) else [0] * size
    t0 = time.monotonic()
    while True:
        now = [int(store.add(incarnation_key(s), 0)) for s in siblings]
        if all(n > f for n, f in zip(now, formed, strict=True)):
            break
        if time.monotonic() - t0 > start_timeout_s:
            late = [s for s, n, f in zip(siblings, now, formed, strict=True) if n <= f]
            raise TooFewWorkers(f"shard group {group} (workers {siblings}) could not be formed: worker(s) {late} did "
                                f"not start again within live.start_timeout_s = {start_timeout_s:g} s; the other "
                                "groups go on without it")
        time.sleep(POLL_S)
    key = "-".join(map(str, now))
    if dist.is_initialized():
        dist.destroy_process_group()  # the worker's group of its own (launch.rendezvous.init_alone)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"sg/{group}/{key}/", store), rank=position,
                            world_size=size, timeout=timedelta(seconds=timeout_s))
    store.set(formed_key(group), json.dumps(now))
    return ShardGroups(size, replica, tuple(now)), incarnation
