"""A unit's gradient reductions: reduce-scatters in flight, a bound on them, and HSDP's all-reduce over replicas.

When backward has produced a unit's full-size gradient, the unit hands it to its
:class:`UnitReduction`, which starts an asynchronous reduce-scatter (average) into this
rank's shard, so the reduction overlaps the rest of backward, and collects the result
when backward is done (:meth:`UnitReduction.collect`). A reduction keeps its input
alive until it completes; the model's units share one :class:`ReductionQueue` that
keeps one reduction in flight, as FSDP2 does, so the unsharded gradient never exists
at once. A completed reduction frees its input's memory itself ([Note: a finished
collective's input]). With hybrid sharding (``zero/hybrid.py``) each reduced shard is
then averaged over the replicate group, the only collective that crosses hosts.

[Note: a finished collective's input] gloo's worker thread holds the work it ran, and
the tensors in it, for a moment after marking it complete: until the work's completion
callbacks have run (dptrain's timing callback needs the GIL, which the training thread
holds) and the thread has dropped its pointer. So when ``wait()`` returns and the unit
drops its last reference, the full-size gradient is freed either at once or a little
later on gloo's thread, depending on scheduling: on a 3-block GPT of width 96 under
ZeRO-2 at world 2, the last units' gradients (unit 2's 270,336 bytes; twice unit 1's)
outlived backward in 18 of 144 rank-steps (issue 46). Once the reduction is done
nothing reads its input, so the reduction releases the input's storage (``resize_(0)``,
as FSDP frees an unsharded buffer) right after waiting, on the training thread: whoever
still holds the tensor holds an empty one, and the memory is gone before backward
returns. Not for an input that outlives the reduction (stage 1's accumulation buffer:
``owned=False``).

The units of one model share a :class:`CommContext` (FSDP2's ``FSDPCommContext``
plays the same part): the queue, the collective check and the current step's
communication record, which ``ZeRO`` swaps for a fresh one after each step.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dptrain import comm
from dptrain.comm.fingerprint import CollectiveCheck
from dptrain.comm.step_stats import StepCommStats
from dptrain.zero.hybrid import ShardGroups
from dptrain.zero.policy import CommPolicy
from dptrain.zero.timing import start_timing

__all__ = ["ReductionQueue", "CommContext", "UnitReduction", "free_storage"]


class ReductionQueue:
    """The reduce-scatters in flight across a model's units, at most ``limit`` at a time.

    A reduction keeps its input, the unit's full-size gradient, alive until it is done.
    Without a bound every unit's full gradient would live until the end of backward:
    the whole unsharded gradient at once, which stage 3 exists to avoid. Before a unit
    launches, the oldest reductions are waited for and their inputs dropped, as torch's
    FSDP2 does (one in flight): a reduction still overlaps the backward of the next
    unit, the one whose gradient is being computed while it runs. Only reductions of a
    temporary gradient count (and, under hybrid sharding, every one: settling it starts
    the replicas' all-reduce): stage 1's accumulation buffer lives on whatever is in
    flight, so its reductions are not held back (each waited for before the next, 1 MiB
    units spent most of a 4-rank backward waiting; docs/tune.md, the sixteenth pass).
    """

    def __init__(self, limit: int = 1):
        if limit < 1:
            raise ValueError(f"at least one reduction must be allowed in flight, got {limit}")
        self.limit = limit
        self._reductions: collections.deque[UnitReduction] = collections.deque()

    def make_room(self) -> None:
        while len(self._reductions) >= self.limit:
            self._reductions.popleft().settle_oldest()

    def add(self, reduction: UnitReduction) -> None:
        self._reductions.append(reduction)

    def clear(self) -> None:
        self._reductions.clear()


@dataclass(eq=False)
class CommContext:
    """What a model's units share: the reduction queue, the collective check (None: off), this step's record.

    ``step_comm`` is replaced by ``ZeRO`` at the end of each synchronising backward (it
    publishes the old one as ``last_step_comm``); units read it at every collective.
    """

    reductions: ReductionQueue
    check: CollectiveCheck | None
    step_comm: StepCommStats


class UnitReduction:
    """Unit ``index``'s reduce-scatters of full-size gradients (``numel`` elements) into its shard ``[lo, hi)``."""

    def __init__(self, index: int, numel: int, bounds: tuple[int, int], dtype: torch.dtype, device: torch.device,
                 groups: ShardGroups, policy: CommPolicy, context: CommContext):
        self.index, self.numel, (self.lo, self.hi) = index, numel, bounds
        self.dtype, self.device, self.context = dtype, device, context
        self.compression = policy.compression
        self.replicate_group = groups.replicate
        # the replicas' all-reduce by a hook instead of a group (ZeRO.register_comm_hook: live recovery's round)
        self.replicate_hook: tuple[object, Callable] | None = None
        self._comm = dict(algorithm=policy.algorithm, group=groups.shard, nodes=policy.nodes, validate=False,
                          traffic=policy.traffic)
        self._replicate_comm = dict(algorithm=policy.algorithm, group=groups.replicate, validate=False,
                                    traffic=policy.traffic)
        # (work, shard result, full-size input (None once waited for), whether to free the input) per reduction
        # of this backward
        self.pending: list[tuple[comm.Work | None, torch.Tensor, torch.Tensor | None, bool]] = []
        # hybrid sharding: this backward's reductions still to come (one per differentiable use in a synced
        # forward), and the reduced pieces held to be averaged over the replicas once, summed, in collect
        self._pieces_due = 0
        self._held: list[torch.Tensor] = []
        self._sent_bytes = self._bytes_per_reduction(policy, groups)

    def _bytes_per_reduction(self, policy: CommPolicy, groups: ShardGroups) -> int:
        """What one reduction sends, counted as the collective is issued (``comm.sent_bytes``)."""
        sent = comm.sent_bytes("reduce_scatter", self.numel, self.dtype.itemsize, algorithm=policy.algorithm,
                               group=groups.shard, nodes=policy.nodes, device=self.device, consume_input=True)
        if groups.replicate is not None:
            sent += comm.sent_bytes("all_reduce", self.hi - self.lo, self.dtype.itemsize,
                                    algorithm=policy.algorithm, group=groups.replicate, device=self.device)
        return sent

    def expect_piece(self) -> None:
        """Hybrid sharding: a synchronising forward used the unit once more, so one more reduction will come."""
        if self.replicated:
            self._pieces_due += 1

    def launch(self, grad_full: torch.Tensor, home: torch.Tensor | None = None, *, owned: bool = True) -> None:
        """Start reducing ``grad_full``, a full-size gradient nothing else reads afterwards.

        It is consumed: the collective works in it rather than in a copy (on gloo, whose
        reduce-scatter is an all-reduce of a copy, it is all-reduced in place), so a
        reduction in flight holds one full-size buffer, not two. ``home``: where the
        shard's result may land when it is the only reduction (stage 1's gradient view).
        ``owned``: ``grad_full`` is a temporary whose memory the reduction frees once done
        ([Note: a finished collective's input]); False for a buffer that outlives it.
        """
        context = self.context
        # bound the full-size gradients alive at once (see ReductionQueue); a lasting buffer costs none, unless
        # its settling starts the replicas' all-reduce (hybrid sharding), which must not wait for backward's end
        queued = owned or self.replicated
        if queued:
            context.reductions.make_room()
        self._pieces_due = max(0, self._pieces_due - 1)
        out = home if home is not None and not self.pending else \
            torch.empty(self.hi - self.lo, dtype=self.dtype, device=self.device)
        if context.check is not None:
            op = "reduce_scatter" if self.compression is None else f"{self.compression.codec.name} reduce_scatter"
            op += f" into {str(out.dtype).removeprefix('torch.')}"  # of the full gradient; shards may differ by one
            context.check.verify_site(("reduce", self.index), op, [grad_full], f"unit {self.index}")
        stats = context.step_comm
        stats.calls += 1
        stats.bytes += grad_full.numel() * grad_full.element_size()
        launched = time.perf_counter()
        if self.compression is not None:  # encoded now; the exchange runs on the compression's own thread
            work = self.compression.reduce_scatter(self.index, out, grad_full)  # counts the bytes it sends
        else:
            stats.sent_bytes += self._sent_bytes
            work = comm.reduce_scatter(out, grad_full, "avg", async_op=True, consume_input=True, **self._comm)
        work = start_timing(work, stats, "reduce-scatter", self.index, grad_full, launched)
        self.pending.append((work, out, grad_full, owned))  # the input stays alive until the reduction is done
        if queued:
            context.reductions.add(self)

    def settle_oldest(self) -> None:
        """Wait for the oldest unfinished reduce-scatter of a temporary gradient and drop that input (HSDP: start the
        replicas')."""
        for i, (_, _, grad_full, owned) in enumerate(self.pending):
            if grad_full is not None and (owned or self.replicated):
                self._settle(i)
                return

    def _settle(self, i: int) -> None:
        work, out, grad_full, owned = self.pending[i]
        work.wait()
        if owned:
            free_storage(grad_full)  # [Note: a finished collective's input]
        if self.replicated and (self._pieces_due or len(self.pending) > 1):
            self._held.append(out)  # a unit used twice (a tied weight): its pieces cross hosts once, summed
            self.pending[i] = (None, out, None, False)
        else:
            self.pending[i] = (self._replicate(out), out, None, False)

    @property
    def replicated(self) -> bool:
        """Whether each reduced shard is averaged over replicas (hybrid sharding: a group, or a hook)."""
        return self.replicate_group is not None or self.replicate_hook is not None

    def _replicate(self, out: torch.Tensor) -> comm.Work | None:
        """Hybrid sharding: start averaging the reduced shard ``out`` over the replicate group (or the hook's)."""
        if not self.replicated:
            return None
        launched = time.perf_counter()
        if self.replicate_hook is not None:
            state, hook = self.replicate_hook
            work = hook(state, ReducedShard(out))
        else:
            work = comm.all_reduce(out, "avg", async_op=True, **self._replicate_comm)
        return start_timing(work, self.context.step_comm, "all-reduce over replicas", self.index, out, launched)

    def collect(self) -> torch.Tensor | None:
        """After backward: wait for every reduction and return their sum (this rank's shard), None if none ran."""
        self._pieces_due = 0
        if not self.pending:
            return None
        for i, (_, _, grad_full, _) in enumerate(self.pending):  # every reduce-scatter done, replicas' started
            if grad_full is not None:
                self._settle(i)
        outs = []
        for work, out, _, _ in self.pending:
            if work is not None:
                work.wait()
            if not any(out is held for held in self._held):
                outs.append(out)
        if self._held:  # one all-reduce over the replicas for the held pieces
            outs.append(self._replicate_held())
        self.pending.clear()
        total = outs[0]
        for out in outs[1:]:
            total.add_(out)
        return total

    def _replicate_held(self) -> torch.Tensor:
        held = self._held[0]
        for piece in self._held[1:]:
            held.add_(piece)
        self._replicate(held).wait()
        self._held = []
        return held


class ReducedShard:
    """What a replicate hook is given: the DDP engine's bucket protocol (``buffer()``), over a reduced shard."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


def free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory now, whoever else still holds the tensor ([Note: a finished collective's input]).

    Only when the tensor covers its whole storage (nothing else lives in it) and the
    storage can be resized; afterwards the tensor must not be read.
    """
    storage = tensor.untyped_storage()
    if storage.resizable() and storage.nbytes() == tensor.numel() * tensor.element_size():
        storage.resize_(0)
