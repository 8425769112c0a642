"""Set up a parameter-server job: every rank calls :func:`build_parameter_server` and gets its role.

    role = build_parameter_server(model, lambda params: torch.optim.AdamW(params.parameters(), lr=1e-3),
                                  num_servers=1, consistency=Consistency("ssp", staleness=2), steps=100)
    if isinstance(role, ShardServer):
        role.serve()
    else:
        ...  # the worker loop of dptrain.ps.worker

Every rank builds ``model`` from the same seed; each server keeps its shard of it, and
the workers start from the servers' copy (the first answer), so they need not agree.
Ranks are global ranks of the default process group: the job is the whole world.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dptrain.ps.consistency import Consistency
from dptrain.ps.layout import Roles, partition
from dptrain.ps.server import ShardServer
from dptrain.ps.snapshot import CutPolicy
from dptrain.ps.wire import DOWN, UP, Link, pair_groups
from dptrain.ps.worker import PSWorker

__all__ = ["build_parameter_server"]


def build_parameter_server(model: nn.Module, build_optimizer: Callable[[nn.Module], torch.optim.Optimizer], *,
                           num_servers: int, consistency: Consistency, steps: int,
                           lr_at: Callable[[int], float] | None = None,
                           grad_clip: float = 0.0, lookahead: bool = False,
                           before_server_step: Callable[[int], None] | None = None,
                           cuts: CutPolicy | None = None, timeout: timedelta | None = None) -> ShardServer | PSWorker:
    """Collective over the default group: this rank's :class:`ShardServer` or :class:`PSWorker`.

    ``cuts``: this rank's part in checkpoints (:mod:`dptrain.ps.snapshot`); None takes none. A resumed
    server is restored (:meth:`ShardServer.restore`) before it serves; a resumed worker gets its clock here.
    ``timeout``: how long any wait on a link or the servers' group may last (None: torch's default for a new
    group, 30 minutes with gloo; ``dptrain run`` passes ``distributed.timeout_s``).
    """
    rank = dist.get_rank()
    roles = Roles(dist.get_world_size(), num_servers)
    consistency.check_workers(roles.num_workers)
    consistency.check_lookahead(lookahead)  # on every rank, before any group is made: no rank is left waiting
    params = list(model.parameters())
    runs = partition([p.numel() for p in params], num_servers)
    groups = pair_groups(roles.workers, roles.servers, timeout)
    server_group = dist.new_group(roles.servers, timeout=timeout) if num_servers > 1 else None
    if roles.is_server(rank):
        links = {w: Link(groups[(w, rank)], w, send_tag=DOWN, recv_tag=UP) for w in roles.workers}
        mine = runs[roles.servers.index(rank)]
        return ShardServer([params[i] for i in mine], build_optimizer, links, consistency, steps, lr_at=lr_at,
                           grad_clip=grad_clip, server_group=server_group, reporter=roles.workers[0],
                           lookahead=lookahead, before_step=before_server_step, cuts=cuts,
                           leader=rank == roles.servers[0])
    links = [Link(groups[(rank, s)], s, send_tag=UP, recv_tag=DOWN) for s in roles.servers]
    return PSWorker(model, links, runs, clip_locally=None if consistency.rounds else (grad_clip or None),
                    reporter=rank == roles.workers[0], cuts=cuts)
