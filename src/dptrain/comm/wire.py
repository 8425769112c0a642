"""Point-to-point transport for dptrain's own collectives, with a byte count.

Every algorithm moves data only through :meth:`Wire.exchange`: post a round's sends and
receives together (as one ``torch.distributed.batch_isend_irecv`` group on NCCL, which
needs that to avoid send/send deadlocks; one by one on gloo), then wait for all of
them. Messages between a pair of ranks match in the order they are posted, so
the algorithms only need to post in the same order on both sides. Empty tensors are
never sent: both sides compute the same sizes and skip them alike.

The :class:`Traffic` counter records what this rank sent (bytes, messages, rounds);
the tests check it against :mod:`dptrain.comm.cost` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Traffic", "Wire", "Workspace"]


@dataclass
class Traffic:
    """What one rank sent through dptrain's collectives (accumulates across calls).

    ``rounds`` counts exchanges that sent or received anything; ``steps`` in the cost
    model are rounds on the critical path, so a rank idle in a round does not count it.
    ``peak_moved`` is the most this rank sent plus received in one round (the
    half-duplex load of :class:`~dptrain.comm.cost.Round`).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    rounds: int = 0
    peak_moved: int = 0
    per_peer: dict[int, int] = field(default_factory=dict)  # bytes sent, by the peer's global rank

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.messages = self.rounds = self.peak_moved = 0
        self.per_peer.clear()


class Workspace:
    """Scratch buffers kept from one collective to the next, one per (slot, dtype, device).

    A fresh buffer of tens of MiB is mapped anew by the allocator and page-faults on
    first write every time: on this project's CPU machines that made a 32 MiB receive
    2.6x slower (docs/repro/fresh_receive_buffer.py). Buffers only grow; a
    workspace belongs to one progress thread, which runs one collective at a time.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
        key = (slot, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]


class Wire:
    """Sends and receives between group ranks of ``group``, counting into ``traffic``."""

    def __init__(self, group: dist.ProcessGroup | None, traffic: Traffic | None = None,
                 workspace: Workspace | None = None):
        self.group = group
        self.traffic = traffic
        self.workspace = workspace
        # NCCL must see a round's sends and receives as one group (or paired sends
        # deadlock); for gloo, which posts them one by one anyway, the grouping only adds
        # the coalescing manager's overhead.
        self._batched = dist.get_backend(group) == "nccl"

    def exchange(self, sends: list[tuple[int, torch.Tensor]] = (),
                 recvs: list[tuple[int, torch.Tensor]] = ()) -> None:
        """One round: send each ``(peer, tensor)`` in ``sends``, fill each in ``recvs``; wait."""
        ops = [(dist.isend, p, t) for p, t in sends if t.numel()] + [(dist.irecv, p, t) for p, t in recvs if t.numel()]
        if not ops:
            return
        if self._batched:
            works = dist.batch_isend_irecv([dist.P2POp(op, t, group=self.group, group_peer=p) for op, p, t in ops])
        else:
            works = [dist.isend(t, group=self.group, group_dst=p) if op is dist.isend
                     else dist.irecv(t, group=self.group, group_src=p) for op, p, t in ops]
        for work in works:
            work.wait()
        if self.traffic is not None:
            self._count(sends, recvs)

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
        """A buffer for incoming data or partial sums (reused across calls when there is a workspace)."""
        if self.workspace is None:
            return torch.empty(numel, dtype=dtype, device=device)
        return self.workspace.get(numel, dtype, device, slot)

    def _count(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        traffic = self.traffic
        traffic.rounds += 1
        received = sum(t.numel() * t.element_size() for _, t in recvs)
        traffic.bytes_received += received
        moved = received
        for peer, t in sends:
            if t.numel():
                nbytes = t.numel() * t.element_size()
                traffic.bytes_sent += nbytes
                traffic.messages += 1
                peer = dist.get_global_rank(self.group, peer) if self.group is not None else peer
                traffic.per_peer[peer] = traffic.per_peer.get(peer, 0) + nbytes
                moved += nbytes
        traffic.peak_moved = max(traffic.peak_moved, moved)
