"""A parameter-server worker: a full replica that pushes its gradient and pulls the new parameters.

The model's parameters and gradients become views of two flat fp32 buffers, so server
``s``'s shard is one contiguous slice of each: a push sends the gradient slice, and the
answer is received straight into the parameter slice (no copy). One step:

    for x, y in batches:                # the worker's own data shard
        loss = loss_fn(model(x), y)
        loss.backward()
        if worker.step(loss.item()):    # push to every server, wait for every answer
            break                       # the budget is spent: the parameters are final
    worker.leave()

In the async modes the worker clips its own gradient before pushing (it is the whole
update); in sync and backup the servers clip the averaged gradient, as DDP does.

Checkpoints (:mod:`dptrain.ps.snapshot`): when the first server's answer names a cut this
worker has not marked, it sends every server a MARK with its clock and its packed state
before its next gradient. A worker resumed from a cut starts at that cut's clock.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dptrain.ps.snapshot import CutPolicy
from dptrain.ps.wire import Kind, Link, PSError, describe_failure

__all__ = ["PSWorker"]


class PSWorker:
    def __init__(self, model: nn.Module, links: list[Link], runs: list[range], *, clip_locally: float | None = None,
                 reporter: bool = False, cuts: CutPolicy | None = None):
        params = [p for p in model.parameters()]
        self.model, self.links, self.clip_locally, self.reporter = model, links, clip_locally, reporter
        self.flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        self.flat_grad = torch.zeros_like(self.flat)
        bounds, offset = [], 0
        for p in params:
            bounds.append((offset, offset + p.numel()))
            p.data = self.flat[offset:offset + p.numel()].view(p.shape)
            p.grad = self.flat_grad[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.slices = [slice(bounds[r.start][0], bounds[r.stop - 1][1]) for r in runs]
        self.clock = cuts.clock if cuts else 0  # gradients pushed (since the start of training)
        self.version = [0] * len(links)
        self.worker_state = cuts.worker_state if cuts else None
        self.cut = self.marked = cuts.label if cuts else 0  # the newest cut the first server named; marked
        self.saved = [self.marked] * len(links)  # each server's newest complete cut
        self.grad_norm = 0.0
        # the loss of the servers' last step: the mean over the gradients it applied (ShardServer.recent_losses)
        self.step_loss = math.nan
        self.stopped = False
        self._receive_all(Kind.PARAMS, Kind.STOP)  # STOP: resumed from the last step's checkpoint
        self._mark()

    def step(self, loss: float = 0.0) -> bool:
        """Push this step's gradient (computed at ``loss``) to every server, receive the new parameters.

        Returns True once the budget is spent.
        """
        self.clock += 1
        self.grad_norm = float(self.flat_grad.norm())
        skip = not math.isfinite(self.grad_norm)
        if self.clip_locally and not skip and self.grad_norm > self.clip_locally:
            self.flat_grad.mul_(self.clip_locally / (self.grad_norm + 1e-6))
        for link, part in zip(self.links, self.slices, strict=True):
            self._guard(link, lambda link=link, part=part: link.send(Kind.GRAD, self.clock, int(skip),
                                                                     payload=self.flat_grad[part], x=loss))
        self._receive_all(Kind.PARAMS, Kind.STOP)
        self._mark()
        self.flat_grad.zero_()
        return self.stopped

    def leave(self) -> dict | None:
        """Tell every server this worker is done; rank 0 then receives the final parameters and the reports."""
        for link in self.links:
            self._guard(link, lambda link=link: link.send(Kind.DONE, self.clock))
        if not self.reporter:
            return None
        self._receive_all(Kind.FINAL)
        return {f"server_rank{link.peer}": self._recv(link).json() for link in self.links}

    def _receive_all(self, *kinds: Kind) -> None:
        for i, (link, part) in enumerate(zip(self.links, self.slices, strict=True)):
            message = self._recv(link, into=self.flat[part])
            if message.kind not in kinds:
                raise PSError(f"parameter server rank {link.peer} sent {message.kind.name}, expected "
                              f"{' or '.join(k.name for k in kinds)}")
            self.version[i] = message.a
            self.saved[i] = message.saved
            if i == 0:
                self.cut = message.cut
                if message.b:
                    self.step_loss = message.x / message.b
            self.stopped |= message.kind == Kind.STOP

    def _mark(self) -> None:
        """Mark the newest cut the first server named, if it is new: this worker's clock to every server, and its
        state to the first, which alone writes the workers' states."""
        if self.cut <= self.marked:
            return
        state = self.worker_state() if self.worker_state else None
        for i, link in enumerate(self.links):
            self._guard(link, lambda link=link, i=i: link.send(Kind.MARK, self.clock,
                                                                payload=state if i == 0 else None, cut=self.cut))
        self.marked = self.cut

    def _recv(self, link: Link, into: torch.Tensor | None = None):
        message = self._guard(link, lambda: link.recv(into=into))
        if message.kind == Kind.ABORT:
            raise PSError(f"parameter server rank {link.peer} ended the run: {message.text()}")
        return message

    @staticmethod
    def _guard(link: Link, call):
        try:
            return call()
        except PSError:
            raise
        except Exception as e:
            raise PSError(f"parameter server rank {link.peer} is gone: {describe_failure(e)}") from e

