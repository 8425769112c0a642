"""The round's process group, and the gradient all-reduce over it, averaged over the members that take part.

A gloo group is made for a round's members (``ProcessGroupGloo`` over the live store, its
keys under ``pg/<round>/``) when the quorum changes, and kept while it does not (torchft
reconfigures only then too; making one costs a connection between every pair, milliseconds
on a LAN). Its timeout is the heartbeat's: a member stopped inside a collective releases
the others within it.

:class:`AveragingHook` is a communication hook (the DDP engine's protocol,
:mod:`dptrain.ddp.comm_hooks`): each bucket is summed over the round's group, asynchronously,
as it fills in backward, and divided by the round's size, so the gradient is the mean over
the participants whatever their number. A collective that fails (a member died) does not
raise inside backward: the hook records the error, leaves the local gradient, and makes no
more collectives this step; the vote then aborts the step (:mod:`~dptrain.live.vote`).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["RoundGroup", "AveragingHook"]

DECIDED_POLL_S = 0.05  # between two looks at the round's decision while waiting


class RoundGroup:
    """The process group of the current round (None alone: a round of one needs none)."""

    def __init__(self, store, timeout_s: float):
        self.store, self.timeout_s = store, timeout_s
        self.pg: dist.ProcessGroup | None = None
        self.round, self.size, self.rank = -1, 1, 0
        self.error: BaseException | None = None  # the first failure of a collective this step
        self.attempt_round = -1  # the round of the attempt under way (the group may be an earlier round's)
        # groups given up on with a collective still pending (a member stopped waiting for it): kept until it ends,
        # since a gloo group destroyed under a pending collective can end the process when that collective fails
        self._abandoned: list[tuple[dist.ProcessGroup, dist.Work]] = []

    def configure(self, round_: int, rank: int, size: int, prefix: str = "") -> None:
        """A new group for ``round_``'s ``size`` members, this worker at ``rank``, its keys under ``prefix`` (default
        ``pg/<round>/``); raises if a member never connects."""
        self.drop()
        self.round, self.size, self.rank = round_, size, rank
        if size > 1:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=self.timeout_s)
            interface = os.environ.get("GLOO_SOCKET_IFNAME")
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=interface) if interface
                             else dist.ProcessGroupGloo.create_default_device()]
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix or f"pg/{round_}/", self.store), rank, size, opts)

    def drop(self) -> None:
        """Let the current group go (its connections close), unless a collective given up on is pending in it."""
        self._abandoned = [(pg, work) for pg, work in self._abandoned if not work.is_completed()]
        self.pg = None

    def close(self, timeout_s: float) -> None:
        """The end: wait (up to ``timeout_s``) for collectives given up on to end, so that none fails in a group being
        destroyed at exit."""
        deadline = time.monotonic() + timeout_s
        while any(not work.is_completed() for _, work in self._abandoned) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._abandoned, self.pg = [], None

    def begin_step(self, round_: int) -> None:
        """A new attempt, in round ``round_`` (whose decision a waiting member watches)."""
        self.error, self.attempt_round = None, round_

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def all_reduce_sum(self, tensor: torch.Tensor) -> dist.Work | None:
        """Start ``tensor``'s sum over the round (in place); None when alone or after this step's first failure."""
        return self._start(lambda pg: pg.allreduce([tensor]))

    def all_gather(self, pieces: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work | None:
        """Start gathering every member's ``tensor`` into ``pieces`` (one per member, in the members' order); None
        when alone or after this step's first failure."""
        return self._start(lambda pg: pg.allgather([pieces], [tensor]))

    def _start(self, collective) -> dist.Work | None:
        if self.pg is None or self.error is not None:
            return None
        try:
            return collective(self.pg)
        except Exception as e:
            self.fail(e)
            return None

    def wait(self, work: dist.Work | None) -> bool:
        """Wait for ``work``; False (the error recorded) if it failed, or if the round was decided meanwhile.

        The wait blocks on an event the work's completion sets (gloo's thread runs the
        callback), waking every :data:`DECIDED_POLL_S` to look at the decision: no spinning,
        which on a machine whose cores the workers share would take their time."""
        if work is None:
            return self.error is None
        try:
            done = threading.Event()
            try:
                work.get_future().add_done_callback(lambda _: done.set())
            except RuntimeError:  # a work without a future: waited for as it is
                done.set()
            while not done.wait(DECIDED_POLL_S):
                if self.store.check([f"q/{self.attempt_round}/decision"]):  # voted down: a member's wait failed
                    self.fail(RuntimeError(f"round {self.attempt_round} was decided while this member waited for "
                                           "its all-reduce (a member's collective failed)"))
                    self._abandoned.append((self.pg, work))
                    return False
            work.wait()
            return True
        except Exception as e:
            self.fail(e)
            return False


class _Averaged:
    """A bucket's handle: ``wait()`` returns the buffer averaged over the round (the local one after a failure)."""

    __slots__ = ("group", "work", "buffer")

    def __init__(self, group: RoundGroup, work, buffer: torch.Tensor):
        self.group, self.work, self.buffer = group, work, buffer

    def wait(self) -> torch.Tensor:
        if self.group.wait(self.work) and self.group.size > 1:
            self.buffer.div_(self.group.size)
        return self.buffer


class AveragingHook:
    """``hook(state, bucket)``: the bucket summed over the round's group and divided by its size (see above)."""

    def __init__(self, group: RoundGroup):
        self.group = group
        self.bytes = 0  # sent this step, for the metrics

    def __call__(self, state, bucket) -> _Averaged:
        buffer = bucket.buffer()
        self.bytes += buffer.numel() * buffer.element_size()
        return _Averaged(self.group, self.group.all_reduce_sum(buffer), buffer)

    def sent_bytes(self, k: int) -> int:
        """What this member sent this step in a round of ``k``: a ring all-reduce's share, ``2 (k - 1) / k``."""
        return self.bytes * 2 * (k - 1) // k

    def settle(self, committed: bool) -> None:
        """The round's decision (nothing kept across steps to undo)."""
        self.bytes = 0

    def reset(self) -> None:
        """Healed from a peer: nothing of its own to drop."""
