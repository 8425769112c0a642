"""A step's timeline: compute on the device, collectives on links, in the order the engines run them.

What :func:`dptrain.planner.simulate.simulate_step` replays (its docstring says what each strategy's schedule
is): :func:`replay` runs the micro-steps of one optimizer step against a :class:`LinkClock` per process group
(the shard group's, and hybrid sharding's replicate group's) and returns when compute ends and when it computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dptrain.planner.layout import Setup, Unit

__all__ = ["Collective", "LinkClock", "Reductions", "replay"]


@dataclass(frozen=True)
class Collective:
    name: str
    launched_s: float
    start_s: float
    end_s: float
    nbytes: int = 0  # the rank's buffer: what it sends and receives, in the dtype on the wire


class LinkClock:
    """One group's collectives, one at a time in launch order: each starts when launched and the link is free.

    ``wire``: another group's clock whose link this one's collectives share (one clock for both: each waits for
    the other's), as hybrid sharding's replica all-reduces and its shard group's collectives do where the shard
    group spans hosts and a rank has one link out of its host.
    """

    def __init__(self, duration: Callable[[str, Unit], tuple[float, int]], wire: LinkClock | None = None):
        self.duration, self.log = duration, []
        self._free = wire._free if wire is not None else [0.0]  # shared with ``wire``

    @property
    def free(self) -> float:
        """When the link's last collective ends."""
        return self._free[0]

    def run(self, kind: str, unit: Unit, index: int, launched: float) -> float:
        start = max(launched, self.free)
        seconds, nbytes = self.duration(kind, unit)
        self._free[0] = start + seconds
        self.log.append(Collective(f"{kind} {index}", launched, start, self.free, nbytes))
        return self.free


class Reductions:
    """ZeRO's reduce-scatters, at most one in flight (``ReductionQueue(1)``), and HSDP's replica all-reduces.

    Before a unit's reduce-scatter is launched, the engine waits, on the compute thread,
    for the previous one; then that unit's shard starts its all-reduce over the replicate
    group, on the replicate group's own link. :meth:`launch` returns when compute can go
    on; :meth:`finish` when the last reduction is done (end of backward's callback).
    ``bounded=False``: none waits for another (ZeRO-1 accumulating in place, without
    replicas: ``Setup.accumulates_in_place``); they queue on the link.
    """

    def __init__(self, shard_link: LinkClock, replica_link: LinkClock | None, sync: bool = True,
                 bounded: bool = True):
        self.shard_link, self.replica_link, self.sync, self.bounded = shard_link, replica_link, sync, bounded
        self._previous: tuple[Unit, int, float] | None = None  # (unit, index, its reduce-scatter's end)

    def launch(self, unit: Unit, index: int, t: float) -> float:
        if not self.sync:  # a no_sync micro-step accumulates locally
            return t
        if not self.bounded:
            self.shard_link.run("reduce_scatter", unit, index, t)
            return t
        t = self._settle(t)
        self._previous = (unit, index, self.shard_link.run("reduce_scatter", unit, index, t))
        return t

    def finish(self, t: float) -> float:
        t = self._settle(t)
        return max(t, self.shard_link.free if self.sync and not self.bounded else 0.0,
                   self.replica_link.free if self.replica_link is not None else 0.0)

    def _settle(self, t: float) -> float:
        if self._previous is None:
            return t
        unit, index, end = self._previous
        t, self._previous = max(t, end), None
        if self.replica_link is not None:
            self.replica_link.run("all_reduce", unit, index, t)
        return t


def replay(shapes: list[Unit], setup: Setup, F: float, B: float, ready: Callable[[Unit], float],
           shard_link: LinkClock, replica_link: LinkClock | None, accum: int = 1,
           overlap: bool = True) -> tuple[float, list[tuple[float, float]]]:
    """One optimizer step of ``accum`` micro-steps from 0: when its compute and reductions end, and the windows
    in which the device computes (forward to backward's end, per micro-step). ``F``, ``B``: a micro-step's forward
    and backward seconds; ``ready(unit)``: the share of backward after which the unit's gradients are complete."""
    t, windows = 0.0, []
    for micro in range(accum):
        sync, start = micro == accum - 1, t
        if setup.stage == 0:  # the DDP engine launches each bucket when it is ready, in bucket order, without waiting
            launched = 0.0
            for i, unit in enumerate(shapes if sync else []):
                launched = max(launched, t + F + B * (ready(unit) if overlap else 1.0))
                shard_link.run("all_reduce", unit, i, launched)
            t = t + F + B
        elif setup.stage < 3:
            if micro == 0:
                for i, unit in enumerate(shapes):  # the updated parameters are gathered before the next forward
                    start = shard_link.run("all_gather", unit, i, t)
                t = start
            reductions = Reductions(shard_link, replica_link, sync,
                                    bounded=not (setup.accumulates_in_place and replica_link is None))
            delay = launched = 0.0  # compute held back by the waits for earlier reductions
            for i, unit in enumerate(shapes):
                launched = reductions.launch(unit, i, max(launched, t + F + B * ready(unit) + delay))
                delay = max(delay, launched - (t + F + B * ready(unit)))
            t = reductions.finish(t + F + B + delay)
        else:
            t = _stage3(shapes, t, F, B, shard_link, Reductions(shard_link, replica_link, sync))
        windows.append((start, t))
    return t, windows


def _stage3(shapes: list[Unit], t0: float, F: float, B: float, link: LinkClock, reductions: Reductions) -> float:
    """ZeRO-3's forward and backward from ``t0``, with prefetching; returns when backward's last reduction is done."""
    blocks = [i for i, u in enumerate(shapes) if u.resharded]
    kept = [i for i, u in enumerate(shapes) if not u.resharded]
    total = sum(u.numel for u in shapes) or 1
    share = {i: shapes[i].numel / total for i in range(len(shapes))}
    root_ready = t0
    for i in kept:  # the root unit: gathered for the whole step
        root_ready = link.run("all_gather", shapes[i], i, t0)
    gathered = {}
    t = t0
    for k, i in enumerate(blocks):  # forward
        if k == 0:
            gathered[i] = link.run("all_gather", shapes[i], i, t0)
        start = max(t, gathered[i], root_ready)
        if k + 1 < len(blocks):
            nxt = blocks[k + 1]
            gathered[nxt] = link.run("all_gather", shapes[nxt], nxt, start)
        t = start + F * share[i]
    t += F * sum(share[i] for i in kept)  # the root's compute (embeddings, head)
    t += B * sum(share[i] for i in kept)  # the head's backward comes first
    order = list(reversed(blocks))
    if order:
        gathered = {order[0]: link.run("all_gather", shapes[order[0]], order[0], t)}
    for k, i in enumerate(order):  # backward
        start = max(t, gathered[i])
        if k + 1 < len(order):
            nxt = order[k + 1]
            gathered[nxt] = link.run("all_gather", shapes[nxt], nxt, start)
        t = reductions.launch(shapes[i], i, start + B * share[i])
    for i in kept:
        t = reductions.launch(shapes[i], i, t)
    return reductions.finish(t)
