"""Gossip (decentralized) SGD: every rank averages parameters with its neighbours, no global all-reduce.

D-PSGD (Lian et al. 2017, "Can decentralized algorithms outperform centralized
algorithms?"): with a doubly stochastic mixing matrix ``W`` over a graph of ranks, each
step is

    x_i <- sum_j W_ij x_j - lr * grad f_i(x_i)

the gradient taken at the rank's own parameters before mixing. Each rank talks only to
its neighbours, so a step costs a few point-to-point messages of the model's size
whatever the world size, and the replicas are not equal: they stay within a
*consensus distance* ``sqrt(mean_i ||x_i - mean x||^2)`` of their average, which the
trainer reports. The model to evaluate and keep is the average of the replicas.

Topologies (both doubly stochastic, so mixing preserves the average):

- ``ring``: neighbours ``r - 1`` and ``r + 1``, weight 1/3 each and 1/3 for itself
  (1/2 and 1/2 with two ranks);
- ``exponential``: one peer per step, at distance ``2^(t mod ceil(log2 N))``: rank ``r``
  sends to ``r + d`` and receives from ``r - d``, weight 1/2 each (Assran et al. 2019,
  "Stochastic gradient push", use this graph); information reaches every rank in
  ``log2 N`` steps instead of ``N / 2``.

The wrapper satisfies the strategies' wrapper protocol
(:class:`~dptrain.strategies.protocol.DataParallelWrapper`): backward leaves each rank's
own gradients (the sync switch does nothing), and ``before_optimizer_step`` runs
:meth:`GossipDataParallel.mix`.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dptrain.comm.average import broadcast_buffers_, consensus_state_dict
from dptrain.utils.weights_file import save_replica_weights

__all__ = ["GossipDataParallel", "TOPOLOGIES", "mixing_peers"]

TOPOLOGIES = ("ring", "exponential")


def mixing_peers(topology: str, rank: int, world_size: int, step: int) -> tuple[list[int], list[int], float]:
    """(ranks to send to, ranks to receive from, the weight of each received copy and of one's own) at ``step``."""
    if world_size == 1:
        return [], [], 1.0
    if topology == "ring":
        peers = sorted({(rank - 1) % world_size, (rank + 1) % world_size})
        return peers, peers, 1.0 / (len(peers) + 1)
    if topology == "exponential":
        distance = 2 ** (step % max(1, math.ceil(math.log2(world_size))))
        return [(rank + distance) % world_size], [(rank - distance) % world_size], 0.5
    raise ValueError(f"unknown gossip topology {topology!r}; use one of {', '.join(TOPOLOGIES)}")


class GossipDataParallel(nn.Module):
    """Each rank trains its own replica and mixes it with its neighbours' after backward."""

    def __init__(self, module: nn.Module, topology: str = "ring", process_group: dist.ProcessGroup | None = None):
        super().__init__()
        mixing_peers(topology, 0, 2, 0)  # validates the name
        self.module, self.topology, self.process_group = module, topology, process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.device = next(module.parameters()).device
        params = [p for p in module.parameters()]
        self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        for p in params:  # parameters become views of one buffer: one message per neighbour
            p.data = self.flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self._received: list[torch.Tensor] = []
        self.steps = 0
        self.bytes_per_mix = 0  # sent by this rank in the last mix
        self.last_mix_s = 0.0
        with torch.no_grad():  # the replicas start equal, as in DDP
            dist.broadcast(self.flat, dist.get_global_rank(process_group or dist.group.WORLD, 0), group=process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ the wrapper protocol

    last_step_comm = None  # a mix is not a gradient reduction: its bytes and seconds are bytes_per_mix, last_mix_s

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Nothing to switch: gradients are never synchronised."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # gradients are never synchronised

    def record_comm_spans(self, on: bool) -> None:
        """Nothing to record: a mix is timed whole (``last_mix_s``)."""

    def before_optimizer_step(self) -> None:
        """D-PSGD: mix the parameters, then the optimizer applies the gradient taken before mixing."""
        self.mix()

    def after_optimizer_step(self) -> None:
        """Nothing: the mix came before the step."""

    def step_metrics(self) -> dict[str, float]:
        """Collective: how far apart the replicas are, and what a mix sends (the step's communication)."""
        return {"consensus_distance": self.consensus_distance(), "comm_bytes_per_step": self.bytes_per_mix,
                "comm_sent_bytes_per_step": self.bytes_per_mix, "gossip_mix_ms": 1e3 * self.last_mix_s}

    def finish(self) -> None:
        """Collective: the replicas averaged exactly, the model to evaluate and keep (buffers: rank 0's)."""
        self.average_()
        broadcast_buffers_(self.module, self.process_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the replicas' mean, as :meth:`finish` would leave them, on a copy."""
        return consensus_state_dict(self.module, self.process_group)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank loads the same state: the replicas are equal again."""
        self.module.load_state_dict(state)  # copies into the flat buffer's views

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """Each rank's own replica (they differ by design), its optimizer state and its mixing step."""
        return {"rank": {"model": self.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "mix_steps": self.steps}}

    def load_checkpoint_state(self, state: dict, optimizer: torch.optim.Optimizer) -> str | None:
        """This rank's own replica, saved on as many ranks; else every replica starts from rank 0's (loaded)."""
        mine = state.get("rank")
        if not mine:
            return "gossip replicas start from rank 0's copy: the checkpoint holds none for this rank"
        self.module.load_state_dict(mine["model"])  # copies into the flat buffer's views
        optimizer.load_state_dict(mine["optimizer"])
        self.steps = mine["mix_steps"]
        return None

    def evaluating(self) -> contextlib.AbstractContextManager[nn.Module]:
        """This rank's replica (an evaluation averages the replicas' losses; the model kept is their mean)."""
        return contextlib.nullcontext(self.module)

    def export_weights(self, path) -> Path | None:
        """Rank 0 writes its replica's state dict (after :meth:`finish`, every replica's average)."""
        return _export_module(self.module, path)

    @torch.no_grad()
    def mix(self) -> None:
        """Replace this rank's parameters with the weighted average of its own and its neighbours' copies."""
        t0 = time.perf_counter()
        send, recv, weight = mixing_peers(self.topology, self.rank, self.world_size, self.steps)
        self.steps += 1
        self.bytes_per_mix = len(send) * self.flat.numel() * self.flat.element_size()
        if not recv:
            return
        while len(self._received) < len(recv):
            self._received.append(torch.empty_like(self.flat))
        group = self.process_group
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        ops = [dist.P2POp(dist.isend, self.flat, to_global(r), group) for r in send]
        buffers = self._received[:len(recv)]  # kept across steps: the exponential graph's peer count varies
        ops += [dist.P2POp(dist.irecv, buf, to_global(r), group) for r, buf in zip(recv, buffers, strict=True)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.flat.mul_(weight)
        for buf in buffers:
            self.flat.add_(buf, alpha=weight)
        self.last_mix_s = time.perf_counter() - t0

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """Collective: ``sqrt(mean_i ||x_i - mean_j x_j||^2)`` over the ranks' replicas."""
        mean = self.flat.clone()
        dist.all_reduce(mean, group=self.process_group)
        mean.div_(self.world_size)
        sq = (self.flat - mean).square().sum().double().reshape(1)
        dist.all_reduce(sq, group=self.process_group)
        return math.sqrt(float(sq) / self.world_size)

    @torch.no_grad()
    def average_(self) -> None:
        """Collective: every replica becomes the exact average (the model to evaluate and keep)."""
        dist.all_reduce(self.flat, group=self.process_group)
        self.flat.div_(self.world_size)


def _export_module(module: nn.Module, path) -> Path | None:
    """Rank 0: ``module``'s state dict (parameters that are views of one flat buffer get storage of their own)."""
    return save_replica_weights(module, path)
