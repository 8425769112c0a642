"""A parameter server: owns a shard of the parameters and their optimizer state, applies pushed gradients.

The server's loop handles one event at a time from a queue that a receiver thread per
worker fills (gradients, departures, deaths), so the rules of
:mod:`~dptrain.ps.consistency` run on one thread in arrival order:

- a gradient is applied at once (async, ssp) or added to the current round (sync,
  backup; a backup round's late gradients are dropped);
- workers whose gradient was applied wait in ``held`` until they may read again (a
  round completes; for ssp, until they are at most ``staleness`` clocks ahead of the
  slowest live worker); then they get the new parameters;
- once the budget is spent (``steps`` rounds, or ``steps x workers`` async gradients),
  every answer is STOP; when all workers have left, rank 0 gets the final shard and a
  report (the staleness histogram, dropped and lost workers).

[Note: one buffer per worker] A worker has at most one gradient in flight: it pushes,
then waits for its answer before it pushes again. So the receiver thread for a worker
can receive every gradient into the same buffer: the server is done with it before it
answers, and the next gradient cannot arrive before the answer.

A worker that dies (its link reports "Connection closed by peer", or it says nothing for
the link's timeout) is dropped from the live set in async, ssp and backup; in sync a
round can never complete without it, so the server sends ABORT with the reason to every
worker and raises.

With several servers the answers go out through an :class:`~dptrain.ps.wire.Outbox` per
worker, so the event loop never waits for a worker to receive (see there why that could
hang the job); one server sends them itself, without the copy.

Checkpoints: with a :class:`~dptrain.ps.snapshot.CutPolicy` the server takes part in the
snapshot protocol of :mod:`dptrain.ps.snapshot` (the first server begins each cut), and
:meth:`ShardServer.restore` continues from one.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dptrain.ps.consistency import Consistency
from dptrain.ps.lookahead import Lookahead
from dptrain.ps.snapshot import CutPolicy, Cuts
from dptrain.ps.wire import Kind, Link, Message, Outbox, PSError, describe_failure

__all__ = ["ShardServer", "Applied"]


@dataclass(frozen=True)
class Applied:
    worker: int
    clock: int        # the worker's clock: this is its clock-th gradient
    staleness: int    # clocks ahead of the slowest live worker when it read (see consistency)
    delay: int        # updates applied between its read and this application
    version: int      # the version this update produced


@dataclass
class _Lost:
    worker: int
    reason: str


@dataclass
class _Round:
    total: torch.Tensor
    workers: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


class ShardServer:
    """Serve ``params`` (this server's whole tensors, copied into one flat fp32 buffer) to ``links``' workers."""

    def __init__(self, params: list[torch.Tensor], build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 links: dict[int, Link], consistency: Consistency, steps: int, *,
                 lr_at: Callable[[int], float] | None = None, grad_clip: float = 0.0,
                 server_group: dist.ProcessGroup | None = None, reporter: int = 0, lookahead: bool = False,
                 before_step: Callable[[int], None] | None = None, cuts: CutPolicy | None = None,
                 leader: bool = True):
        consistency.check_workers(len(links))
        consistency.check_lookahead(lookahead)
        self.links, self.consistency, self.steps = links, consistency, steps
        self.lr_at, self.grad_clip, self.server_group, self.reporter = lr_at, grad_clip, server_group, reporter
        self.before_step = before_step  # called with the 1-based step of each update about to be applied
        self.flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        self.flat_grad = torch.zeros_like(self.flat)
        self.params = nn.ParameterList()
        offset = 0
        for p in params:  # parameters as views of the flat buffers: one message per answer
            view = nn.Parameter(self.flat[offset:offset + p.numel()].view(p.shape))
            view.grad = self.flat_grad[offset:offset + p.numel()].view(p.shape)
            self.params.append(view)
            offset += p.numel()
        self.optimizer = build_optimizer(self.params)
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]  # used when there is no lr_at
        self.lookahead = Lookahead(self.optimizer, self.params, self.flat, list(links)) if lookahead else None
        self.num_workers = len(links)
        self.version = self.skipped = 0  # version: updates applied (a round's, or one gradient's)
        # The losses of the last step's gradients, sent with every answer: the last round's (every worker's
        # in sync, as DDP's logged loss), or in the async modes the last gradient of each of the workers.
        self.recent_losses: deque[float] = deque(maxlen=len(links))
        self.records: list[Applied] = []
        self.dropped: list[Applied] = []
        self.lost: dict[int, str] = {}
        self.clock = {w: 0 for w in links}
        self.read_version = {w: 0 for w in links}
        self.read_staleness = {w: 0 for w in links}
        self.live, self.held = set(links), set()
        self.round = _Round(torch.zeros_like(self.flat))
        self.events: queue.Queue = queue.Queue()
        self._buffers = {w: torch.empty_like(self.flat) for w in links}  # [Note: one buffer per worker]
        self.outboxes: dict[int, Outbox] = {}  # with several servers, each worker's, from serve() on
        self.leader = leader  # the first server: it begins every checkpoint cut
        self.cuts = None if cuts is None or cuts.writer is None else \
            Cuts(cuts.schedule, cuts.writer, in_flight=not consistency.rounds, begun=cuts.label)

    # ------------------------------------------------------------------ loop

    def serve(self) -> dict:
        """Serve until every worker has left or died; returns the report sent to rank 0."""
        t0 = time.perf_counter()
        if self.server_group is not None:  # several servers: answers must not wait for their worker (Outbox)
            self.outboxes = {w: Outbox(link, lambda e, w=w: self.events.put(_Lost(w, describe_failure(e))))
                             for w, link in self.links.items()}
        self.held.update(self.live)  # every worker waits for its first parameters (SSP's bound holds on resume)
        self._progress()
        for w, link in self.links.items():
            threading.Thread(target=self._receive, args=(w, link), daemon=True, name=f"ps-recv-{w}").start()
        while self.live:
            event = self.events.get()
            if isinstance(event, _Lost):
                self._lose(event.worker, event.reason)
                continue
            w, message = event
            if message.kind == Kind.GRAD:
                if self.cuts:
                    self.cuts.record(w, message)
                self._accept(w, message)
                self._progress()
            elif message.kind == Kind.MARK:
                self._on_mark(w, message)
            elif message.kind == Kind.DONE:
                self.live.discard(w)
                self.held.discard(w)
                if self.cuts:  # a worker marks every cut before it leaves; this closes what it could not mark
                    self.cuts.mark(w, math.inf, message.a, None, self.live)
                self._progress()
        self._close_outboxes()
        report = self.report(time.perf_counter() - t0)
        self._send_final(report)
        return report

    def _receive(self, w: int, link: Link) -> None:
        while True:
            try:
                message = link.recv(into=self._buffers[w])
            except Exception as e:  # a dead peer or a timeout: gloo says which
                self.events.put(_Lost(w, describe_failure(e)))
                return
            self.events.put((w, message))
            if message.kind == Kind.DONE:
                return

    # ----------------------------------------------------------------- rules

    @property
    def spent(self) -> bool:
        budget = self.steps if self.consistency.rounds else self.steps * self.num_workers
        return self.version >= budget

    def _accept(self, w: int, message: Message) -> None:
        """The rules for one gradient: apply it or add it to the round, and hold its worker (answered by _progress)."""
        self.clock[w] = message.a
        if self.spent:
            self.held.add(w)
        elif self.consistency.rounds:
            if self.read_version[w] < self.version:  # a backup round went on without it
                self.dropped.append(Applied(w, message.a, 0, self.version - self.read_version[w], self.version))
                self.held.add(w)
            else:
                self.round.total += message.payload
                self.round.workers.append(w)
                self.round.losses.append(message.x)
        else:
            delay = self.version - self.read_version[w]
            if self.lookahead:
                self.lookahead.observe(w, delay)
            self._apply(message.payload, 1.0 / self.num_workers, skip=bool(message.b))
            self.recent_losses.append(message.x)
            self.records.append(Applied(w, message.a, self.read_staleness[w], delay, self.version))
            self.held.add(w)
            self._begin_due_cuts()

    def _progress(self) -> None:
        """Close a round if it has its gradients, then answer every held worker that may go on."""
        done = self.round.workers
        if self.consistency.rounds and done and len(done) >= self.consistency.needed(self.num_workers,
                                                                                       len(self.live)):
            self._apply(self.round.total.div_(len(done)), 1.0)
            self.recent_losses.clear()
            self.recent_losses.extend(self.round.losses)
            self.records += [Applied(w, self.clock[w], 0, 0, self.version) for w in done]
            self.held.update(done)
            self.round = _Round(self.round.total.zero_())
            self._begin_due_cuts()
        slowest = min((self.clock[w] for w in self.live), default=0)
        for w in sorted(self.held):
            if w not in self.held:  # answered (or lost) by a nested call while this loop ran
                continue
            if self.spent:
                self._answer(w, Kind.STOP)
            elif self.clock[w] - slowest <= self.consistency.bound:
                self.read_staleness[w] = max(0, self.clock[w] - slowest)
                self._answer(w, Kind.PARAMS)

    def _apply(self, grad: torch.Tensor, lr_scale: float, skip: bool = False) -> None:
        """One optimizer step on ``grad``; in rounds the gradient norm is clipped over every server's shard."""
        if self.before_step:
            self.before_step(self._step() + 1)
        self.flat_grad.copy_(grad)
        if self.consistency.rounds:
            sq = self.flat_grad.double().square().sum().reshape(1)
            if self.server_group is not None:
                dist.all_reduce(sq, group=self.server_group)
            norm = math.sqrt(sq.item())
            skip = not math.isfinite(norm)
            if self.grad_clip > 0 and norm > self.grad_clip and not skip:
                self.flat_grad.mul_(self.grad_clip / (norm + 1e-6))
        for group, lr in zip(self.optimizer.param_groups, self._next_lrs(lr_scale), strict=True):
            group["lr"] = lr
        if skip:
            self.skipped += 1
        else:
            self.optimizer.step()
        self.version += 1

    # ---------------------------------------------------------- checkpoints

    def _begin_due_cuts(self) -> None:
        """After an update: record this server's state for a cut whose step it has reached (dptrain.ps.snapshot).

        The leader does; in the round modes every server does, since they close each round together."""
        if self.cuts and (self.leader or self.consistency.rounds):
            self.cuts.begin(self._step(), self.state_dict)

    def _on_mark(self, w: int, message: Message) -> None:
        if not self.cuts:
            return
        if not self.leader and not self.consistency.rounds:  # its first MARK of a cut: its moment to record it
            self.cuts.begin(message.cut, self.state_dict)
        self.cuts.mark(w, message.cut, message.a, message.payload, self.live)

    def state_dict(self) -> dict:
        """What a resumed server needs: the shard, optimizer and look-ahead state, version, the workers' clocks and
        reads, and the report's counts. The tensors are the live ones: save them before the next update.

        Not kept: a half-collected backup round (its gradients count as dropped, as a late one is), the held and
        lost workers (a resumed job starts with every worker waiting for parameters)."""
        return {"flat": self.flat, "optimizer": self.optimizer.state_dict(), "version": self.version,
                "skipped": self.skipped, "clock": dict(self.clock), "read_version": dict(self.read_version),
                "read_staleness": dict(self.read_staleness), "recent_losses": list(self.recent_losses),
                "records": _rows(self.records), "dropped": _rows(self.dropped),
                "expected": dict(self.lookahead.expected) if self.lookahead else None}

    def load_state_dict(self, state: dict) -> None:
        if state["flat"].shape != self.flat.shape:
            raise PSError(f"a checkpointed shard of {state['flat'].numel():,} elements cannot load into this server's "
                          f"{self.flat.numel():,}: it was saved with another model or another ps.servers")
        with torch.no_grad():
            self.flat.copy_(state["flat"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.skipped = state["version"], state["skipped"]
        self.clock.update(state["clock"])
        self.read_version.update(state["read_version"])
        self.read_staleness.update(state["read_staleness"])
        self.recent_losses.extend(state["recent_losses"])
        self.records = [Applied(*row) for row in state["records"].tolist()]
        self.dropped = [Applied(*row) for row in state["dropped"].tolist()]
        if self.lookahead and state["expected"]:
            self.lookahead.expected.update(state["expected"])

    def restore(self, state: dict, in_flight: list[tuple[int, Message]], clocks: dict[int, int]) -> None:
        """Continue from a cut: this server's recorded state, then the gradients it recorded in flight (applied now,
        in their arrival order), then every worker's clock in the cut. Call before :meth:`serve`."""
        self.load_state_dict(state)
        for w, message in in_flight:
            self._accept(w, message)
        self.held.clear()
        self.clock.update(clocks)

    # ------------------------------------------------------------- schedule

    def _step(self) -> int:
        """The schedule's step of the next update: rounds so far, or async gradients so far / workers."""
        return self.version if self.consistency.rounds else self.version // self.num_workers

    def _next_lrs(self, lr_scale: float) -> list[float]:
        """Each parameter group's learning rate for the next update: the schedule at the server's step."""
        if self.lr_at:
            return [self.lr_at(self._step()) * lr_scale] * len(self.base_lrs)
        return [lr * lr_scale for lr in self.base_lrs]

    # -------------------------------------------------------------- messages

    def _answer(self, w: int, kind: Kind) -> None:
        self.held.discard(w)
        self.read_version[w] = self.version
        payload = self.flat
        if self.lookahead and kind == Kind.PARAMS:
            payload = self.lookahead.predict(w, self._next_lrs(1.0 / self.num_workers)[0], self.version)
        try:
            self._link(w).send(kind, self.version, len(self.recent_losses), payload=payload,
                               x=sum(self.recent_losses), **self._labels())
        except Exception as e:
            self._lose(w, describe_failure(e))

    def _lose(self, w: int, reason: str) -> None:
        if w not in self.live:
            return
        self.live.discard(w)
        self.held.discard(w)
        self.lost[w] = reason
        if self.consistency.mode == "sync" or w == self.reporter:
            why = (f"worker rank {w} is gone ({reason}); "
                   + ("rank 0 writes the run's results, so the run cannot go on" if w == self.reporter else
                      "a sync round needs every worker; the async, ssp and backup modes go on without it"))
            for other in sorted(self.live):
                try:
                    self._link(other).send_text(Kind.ABORT, why)
                except Exception:
                    pass
            self._close_outboxes()
            raise PSError(why)
        if self.cuts:  # it marks nothing more: its cut is its last gradient here
            self.cuts.mark(w, math.inf, self.clock[w], None, self.live)
        if self.consistency.rounds and self.consistency.needed(self.num_workers, len(self.live)) < 1:
            return
        self._progress()

    def _link(self, w: int) -> Link | Outbox:
        return self.outboxes.get(w) or self.links[w]

    def _close_outboxes(self) -> None:
        for outbox in self.outboxes.values():
            outbox.close()
        self.outboxes = {}

    def _send_final(self, report: dict) -> None:
        if self.reporter in self.lost:
            return
        link = self.links[self.reporter]
        link.send(Kind.FINAL, self.version, payload=self.flat, **self._labels())
        link.send_text(Kind.REPORT, json.dumps(report))

    def _labels(self) -> dict[str, int]:
        """The checkpoint labels an answer carries: the newest cut begun (the leader's marker), the newest complete."""
        if not self.cuts:
            return {}
        return {"cut": self.cuts.begun if self.leader else 0, "saved": self.cuts.saved}

    def report(self, wall_s: float) -> dict:
        """What the run summary shows: versions, applied and dropped gradients, staleness and delay histograms."""
        return {"mode": self.consistency.mode, "updates": self.version, "gradients": len(self.records),
                "skipped": self.skipped, "dropped": len(self.dropped),
                "staleness": _histogram(r.staleness for r in self.records),
                "delay": _histogram(r.delay for r in self.records),
                "applied_per_worker": _histogram(r.worker for r in self.records),
                "lost_workers": {str(w): why for w, why in self.lost.items()}, "wall_s": wall_s}


def _rows(records: list[Applied]) -> torch.Tensor:
    return torch.tensor([[r.worker, r.clock, r.staleness, r.delay, r.version] for r in records],
                        dtype=torch.int64).reshape(-1, 5)


def _histogram(values) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}

