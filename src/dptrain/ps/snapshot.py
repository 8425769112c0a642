"""Consistent checkpoints of a parameter-server job, taken while it trains: a Chandy-Lamport snapshot.

Algorithm (Chandy and Lamport 1985, "Distributed snapshots"). A job has no moment at
which every shard has seen the same gradients: each server applies them in its own
arrival order. Stopping everyone for a checkpoint would make one (every worker waits,
every server drains), but a send blocks until its receiver is ready, and a worker held
by SSP's bound on one server cannot take another server's message: a pause can deadlock.
So nobody stops. The markers of a distributed snapshot travel on the job's FIFO
channels, the (worker, server) links:

1. The first server (the *leader*) records its state once its step reaches a cut's
   label (every ``checkpoint.every`` steps, and the last step). From then on every
   answer it sends names the newest cut: the marker on the leader -> worker channels.
2. A worker that hears of a cut it has not marked records its state (its clock: the
   gradients it pushed, so its data position; its random streams and buffers) and sends
   ``MARK`` with it to every server before its next gradient: the markers on the
   worker -> server channels. One MARK marks every cut up to the one it names.
3. Every other server records its state at its first MARK of a cut (in the async modes;
   the round modes are below).
4. From its own snapshot until worker ``w``'s MARK, a server records the gradients that
   arrive from ``w`` (*in flight*): ``w`` pushed them before its cut, so they belong to
   it, but this server applied them after its snapshot. A cut is complete on a server
   once every live worker has marked it; a worker that died or left counts as marked at
   its last gradient.

For every worker ``w`` and every shard, the cut then holds exactly ``w``'s gradients
``1..c_w``, ``c_w`` being the clock of its MARK: the ones applied before the server's
snapshot, and the recorded ones, which a resumed server applies before it answers
anyone. The shards agree on which gradients they hold, though each was recorded at
another moment. The cost: a copy of each in-flight gradient, at most one per worker and
server, held until the cut completes.

In the round modes (sync, backup) the servers close round ``label`` together (the
clipping norm is an all-reduce among them), so each records its state right after it,
not at a MARK; the leader's markers reach every worker with that round's answers, before
any gradient of the next round. Nothing is in flight: sync's cut is the state after step
``label`` on every rank, so a resumed sync run continues bit for bit. A backup gradient that is
in flight at the cut was computed before the round and would be dropped as late, so the
round modes record nothing in flight (and a server keeps no half-collected round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dptrain.ps.wire import Kind, Message

__all__ = ["Cut", "CutPolicy", "CutSchedule", "CutWriter", "Cuts", "transit_messages"]


@dataclass(frozen=True)
class CutSchedule:
    """The cuts a job takes, labelled by step: every ``every`` steps (0: none between) and the last, ``steps``."""

    every: int
    steps: int

    def due(self, after: int, step: int) -> list[int]:
        """The labels in ``(after, step]``, in order."""
        step = min(step, self.steps)
        labels = []
        if self.every > 0:
            first = (after // self.every + 1) * self.every
            labels = [k for k in range(first, step + 1, self.every) if k < self.steps]
        if after < self.steps <= step:
            labels.append(self.steps)
        return labels


@dataclass
class Cut:
    """One cut on one server: the workers' marks and the gradients recorded in flight, in arrival order."""

    label: int
    marks: dict[int, tuple[int, torch.Tensor | None]] = field(default_factory=dict)  # worker -> (clock, state)
    transit: list[tuple[int, Message]] = field(default_factory=list)

    def transit_state(self) -> list[dict]:
        """The recorded gradients as plain data (``weights_only`` loads it); :func:`transit_messages` inverts it."""
        return [{"worker": w, "clock": m.a, "skip": m.b, "loss": m.x, "grad": m.payload} for w, m in self.transit]


def transit_messages(rows: list[dict]) -> list[tuple[int, Message]]:
    return [(r["worker"], Message(Kind.GRAD, r["clock"], r["skip"], r["grad"], r["loss"])) for r in rows]


class CutWriter(Protocol):
    """Where one server's cuts go (``dptrain.ps.checkpoint.CutFiles`` in ``dptrain run``)."""

    def snapshot(self, label: int, state: dict) -> None:
        """Keep ``state`` (live tensors: save them before returning) as this server's state in cut ``label``."""

    def close(self, cut: Cut) -> None:
        """Keep the cut's in-flight gradients and marks; after this the server reports the cut complete."""


@dataclass(frozen=True)
class CutPolicy:
    """How a job checkpoints, for one rank.

    ``writer``: a server's (None on a worker; a job without one takes no cuts).
    ``worker_state``: a worker's state for its MARK, packed (``dptrain.ps.wire.pack``).
    ``label``: the cut the job resumes from (0: a fresh start); ``clock``: this worker's clock in it.
    """

    schedule: CutSchedule
    writer: CutWriter | None = None
    worker_state: Callable[[], torch.Tensor] | None = None
    label: int = 0
    clock: int = 0


class Cuts:
    """One server's side of the protocol: the cuts it has recorded but not completed.

    ``begun``: the newest cut recorded here (the leader names it in its answers); ``saved``:
    the newest complete one (every server reports it, and rank 0 publishes a cut that all
    of them report).
    """

    def __init__(self, schedule: CutSchedule, writer: CutWriter, *, in_flight: bool, begun: int = 0):
        self.schedule, self.writer, self.in_flight = schedule, writer, in_flight
        self.begun = self.saved = begun
        self.open: dict[int, Cut] = {}

    def begin(self, step: int, state: Callable[[], dict]) -> None:
        """Record this server's state for every cut due by ``step``: the leader's step, or a MARK's cut."""
        due = self.schedule.due(self.begun, step)
        if not due:
            return
        snapshot = state()
        for label in due:
            self.writer.snapshot(label, snapshot)
            self.open[label] = Cut(label)
            self.begun = label

    def record(self, worker: int, message: Message) -> None:
        """A gradient from ``worker``: kept (a copy) by every open cut that ``worker`` has not marked."""
        if not self.in_flight:
            return
        copy = None
        for cut in self.open.values():
            if worker not in cut.marks:
                copy = copy if copy is not None else Message(message.kind, message.a, message.b,
                                                             message.payload.clone(), message.x)
                cut.transit.append((worker, copy))

    def mark(self, worker: int, upto: float, clock: int, state: torch.Tensor | None, live: set[int]) -> None:
        """``worker`` marks every open cut up to ``upto`` at ``clock``; complete cuts are closed, oldest first."""
        for cut in self.open.values():
            if cut.label <= upto and worker not in cut.marks:
                cut.marks[worker] = (clock, state)
        for label in sorted(self.open):
            cut = self.open[label]
            if not live <= cut.marks.keys():
                break
            self.writer.close(cut)
            del self.open[label]
            self.saved = label
