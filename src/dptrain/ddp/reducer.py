"""The reducer: turns gradient-ready events into bucket all-reduces that overlap backward.

Algorithm (Li et al., VLDB 2020, section 3.2; torch's ``reducer.cpp`` does the same):

1. After a synced forward, every parameter gets an *expected* number of gradient
   accumulations for the coming backward (``arrivals.py``): normally 1; 0 for a
   parameter known to be unused; 2 or more for a parameter whose gradient arrived in
   pieces last step (a weight shared between reentrant-checkpoint segments).
2. Each parameter's post-accumulate-grad hook records its arrival in its bucket's
   *arrival log*; for most parameters the hook is the log's own ``list.append``, a C
   function, so autograd runs no Python frame for them ([Note: arrival logs] in
   ``arrivals.py``). One parameter per bucket, its *trigger* (the one whose gradient
   came last in the previous step), has a Python hook: it checks whether the bucket is
   complete (every expected gradient logged) and, if so and every earlier bucket has
   been launched, copies the gradients into the bucket's flat buffer
   in one batched operation (``Bucket.fill``, the one way in), divided by the world size
   on the way (dividing before the sum also keeps fp16 buckets from overflowing), and
   hands it to the communication hook, the one way out: by default ``SumAllReduce``, an
   asynchronous ``dptrain.comm.all_reduce`` (as torch's reducer treats its all-reduce as
   the default hook), while backward continues on earlier layers.
3. At the end of the outermost backward (see [Note: finalize on the outermost backward]
   in ``autograd.py``) buckets not yet launched are launched, in order, all handles are
   waited for, in order, and the averaged gradients are written to ``.grad``.

[Note: buckets launch in index order]
Collectives must be issued in the same order on every rank. A parameter unused on one
rank but used on another makes buckets *ready* in different orders, so a bucket is
launched only after all lower-numbered buckets, never merely because it is ready.

The first synced backward is a discovery pass: nothing is copied or launched before the
end (as in torch DDP 2.13, whose first iteration uses a single bucket), and the
observed arrival counts become the next step's expectations. A gradient that arrives
after its bucket was launched (a dynamic graph that changed between steps) is not lost:
the bucket is reduced again at the end of backward with the complete local gradients.
"""

from __future__ import annotations

import enum
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dptrain import comm
from dptrain.comm.fingerprint import CollectiveCheck
from dptrain.comm.step_stats import StepCommStats
from dptrain.ddp.arrivals import ArrivalLog, GradientArrivals, UnusedParametersError, Want, unused_message
from dptrain.ddp.autograd import grad_accumulator, queue_on_current_backward, will_accumulate
from dptrain.ddp.buckets import Bucket, SparseGradient
from dptrain.ddp.comm_hooks import CommHook, GradBucket, ReduceHandle, SumAllReduce, hook_name
from dptrain.ddp.optimizer_in_backward import BucketOptimizer

__all__ = ["Reducer", "StepCommStats", "UnusedParametersError"]


class _Phase(enum.Enum):
    IDLE = "idle"                  # no backward expected
    ACCUMULATE = "accumulate"      # a no_sync forward ran: gradients accumulate locally
    EXPECT_SYNC = "expect_sync"    # a synced forward ran: its backward will reduce
    REDUCING = "reducing"          # that backward is running: buckets launch when ready


# A gradient this large (256 KiB in fp32) is copied into its bucket when it arrives, on CPU: measured on the
# 16M-parameter MLP (2M-element weights), copying whole buckets at launch instead cost 2-6% of a step, the
# gradients having left the cache by then (docs/benchmarks.md).
EAGER_NUMEL = 1 << 16


class Reducer:
    """Bucketed, overlapped gradient averaging for a fixed list of parameters."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        bucket_indices: list[list[int]],
        process_group: dist.ProcessGroup,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        algorithm: str = "native",
        nodes: int | Sequence[Sequence[int]] | None = None,
        traffic: comm.Traffic | None = None,
        check: CollectiveCheck | None = None,
    ):
        self.params = params
        self.check = check            # fingerprints each bucket's first reduction (or every one) across ranks
        self.names = names
        self.process_group = process_group
        # The one way out of a bucket: hook(state, bucket). The default sums with dptrain.comm (algorithm, nodes;
        # traffic counts its bytes sent); register_comm_hook replaces it.
        self.default_hook = SumAllReduce(process_group, algorithm, nodes, traffic)
        self.divisor = dist.get_world_size(process_group)  # see join.py for when it changes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.arrivals = GradientArrivals(params, find_unused_parameters, static_graph)
        self.buckets = [Bucket(b, [params[i] for i in idx], idx) for b, idx in enumerate(bucket_indices)]
        self.default_hook.prepare([bucket.buffer for bucket in self.buckets])
        self.register_comm_hook(None, self.default_hook)
        self._bucket_of = [0] * len(params)
        self._position = [0] * len(params)
        for bucket in self.buckets:
            for position, i in enumerate(bucket.param_indices):
                self._bucket_of[i], self._position[i] = bucket.index, position
        # Gradients of at least EAGER_NUMEL elements are copied into their bucket as they arrive, while they are in
        # the CPU's cache; smaller ones with their bucket, in one batched op at its launch. On a GPU every gradient
        # waits for the batched op: there a copy costs a kernel launch, not cache misses.
        eager = EAGER_NUMEL if params[0].device.type == "cpu" else None
        self._eager = [eager is not None and p.numel() >= eager for p in params]
        # Held so that autograd keeps using these nodes: will_accumulate() asks about them.
        self._accumulators = [grad_accumulator(p) for p in params]
        self._phase = _Phase.IDLE
        self._want_for: tuple[list[int] | None, list[Want]] = (None, [])  # (expected, what completes each bucket)
        self._discovering = True                      # arrivals.discovering, read once per backward
        self._generation = 0                          # synced forwards so far
        self._finalized_through = 0                   # generations whose backward is reduced
        self._want: list[Want] = []                   # what completes each bucket this backward
        # The gradients accumulated this backward, per bucket ([Note: arrival logs]); a Python hook for
        # each bucket's trigger and for the large CPU gradients copied as they arrive.
        # [Note: nothing holds the reducer but its module]: the hooks' maker refers to it weakly.
        self._log = ArrivalLog(params, bucket_indices, _grad_hook_maker(weakref.ref(self)), self._eager)
        self._reset_step()
        self.last_stats = StepCommStats()
        self.bucket_optimizer: BucketOptimizer | None = None  # optimizer_in_backward: steps each written bucket

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce buckets with ``hook(state, bucket)``: what is divided on the way in, checked and counted follows."""
        self.comm_hook, self.comm_state = hook, state
        default = hook is self.default_hook
        self._divides = default and not hook.averages  # the division is fused into the copy into the bucket
        self._check_op = "all_reduce" if default else f"comm hook {hook_name(hook)}"
        # bytes sent, by the cost model, for the default hook (a custom hook's traffic is its own)
        self._sent_bytes = [comm.sent_bytes("all_reduce", b.numel, b.buffer.element_size(), algorithm=hook.algorithm,
                                            group=self.process_group, nodes=hook.nodes, device=b.buffer.device)
                            if default else 0 for b in self.buckets]

    @property
    def record_spans(self) -> bool:
        """Exact per-bucket completion times (``StepCommStats.bucket_spans``); otherwise stamped when waited for."""
        return self.default_hook.timed

    @record_spans.setter
    def record_spans(self, on: bool) -> None:
        self.default_hook.timed = on

    # ----------------------------------------------------------------- forward side

    def prepare_for_backward(self, outputs: list[torch.Tensor], forward_comm: tuple[int, int] = (0, 0)) -> int:
        """Called at the end of a synced forward; returns the generation its backward hook carries.

        ``forward_comm`` is the (calls, bytes) the forward itself communicated (buffer
        broadcasts), counted into this step's statistics.
        """
        self._abandon_unfinished_backward()
        expected = self.arrivals.expected(outputs)
        calls, nbytes = forward_comm
        if self._phase is _Phase.EXPECT_SYNC:  # several forwards before one backward
            expected = [max(a, b) for a, b in zip(expected, self._expected, strict=True)]
            calls, nbytes = calls + self._stats.calls, nbytes + self._stats.bytes
        else:
            self._generation += 1
        self._take_unsynced_arrivals()
        self._reset_step()
        self._expected = expected
        if expected != self._want_for[0]:  # the same expectations as last step (usual): the same wants
            self._want_for = (expected, [Want.of(b, expected) for b in self.buckets])
        self._want = self._want_for[1]
        self._discovering = self.arrivals.discovering
        self._phase = _Phase.EXPECT_SYNC
        self._stats.calls, self._stats.bytes = calls, nbytes
        return self._generation

    def prepare_for_accumulation(self) -> None:
        """Called at the end of a ``no_sync`` forward: its backward will not communicate.

        A synced forward still waiting for its backward takes precedence: one backward
        through both outputs reduces, as in torch.
        """
        self._abandon_unfinished_backward()
        self._take_unsynced_arrivals()
        if self._phase is not _Phase.EXPECT_SYNC:
            self._phase = _Phase.ACCUMULATE

    def _take_unsynced_arrivals(self) -> None:
        """Read and clear the logs of a backward that did not reduce (``no_sync``), at the next forward.

        Such gradients count as used for ``find_unused_parameters``' map, which spans
        ``no_sync`` steps. Gradients logged after a synced forward whose backward never
        started the reduction were not averaged: that is an error ([Note: arrival logs]).
        """
        log = self._log
        if log.is_empty():
            return
        if self._phase is _Phase.EXPECT_SYNC:
            names = [self.names[i] for i in log.indices()]
            log.clear()
            raise RuntimeError(
                f"a backward after a synced forward accumulated gradients for {len(names)} parameter(s) "
                f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}) without reaching that forward's "
                "outputs, so they were not averaged across ranks. Build the loss from the DDP module's "
                "outputs, or run that backward under model.no_sync().")
        if self._phase is _Phase.ACCUMULATE and self.arrivals.needs_used_map():
            self.arrivals.mark_used(log.indices())
        log.clear()

    def _abandon_unfinished_backward(self) -> None:
        """A backward raised after launching buckets: wait for them, then start afresh.

        Their results are discarded, but an all-reduce left running would write into a
        bucket buffer while the next step fills it.
        """
        if self._phase is not _Phase.REDUCING:
            return
        warnings.warn("the previous backward did not complete (an exception during backward?); its "
                      "in-flight gradient reductions were waited for and discarded", RuntimeWarning,
                      stacklevel=4)
        handles = self._handles
        self._phase = _Phase.IDLE
        self._finalized_through = self._generation
        self.arrivals.forget_used()
        self._log.clear()
        self._reset_step()
        for handle, _ in handles:
            handle.wait()

    def backward_callback(self, generation: int) -> Callable[[], None]:
        """What runs when a backward reaches the outputs of forward ``generation``."""
        reducer_ref = weakref.ref(self)

        def on_backward() -> None:
            reducer = reducer_ref()
            if reducer is not None:
                reducer._begin_reduction(generation)

        return on_backward

    # ---------------------------------------------------------------- backward side

    def _begin_reduction(self, generation: int) -> None:
        if not will_accumulate(self._accumulators):
            return  # e.g. autograd.grad(out, inputs) for a gradient penalty: no .grad written
        if generation <= self._finalized_through:
            raise RuntimeError(
                "backward ran through a forward whose gradients were already reduced "
                "(e.g. a second loss.backward(retain_graph=True) on the same output). "
                "Run the forward again for each backward, or wrap the extra backward "
                "passes in model.no_sync().")
        if self._phase is not _Phase.EXPECT_SYNC:
            return  # another output node of the same backward
        self._phase = _Phase.REDUCING
        self._stats.backward_start = time.perf_counter()
        queue_on_current_backward(self._finalize)
        self._launch_ready_buckets()

    def _on_grad_accumulated(self, index: int, param: torch.Tensor) -> None:
        """A trigger's or a large CPU gradient's piece landed in ``param.grad``: log it; launch what is complete.

        The other parameters' hooks only log ([Note: arrival logs]). Gradients are copied
        into a bucket by one batched operation when it launches (``Bucket.fill``), so a
        piece that arrives after the bucket is complete but before its launch is still in
        (the latest sum wins). Only a gradient of ``EAGER_NUMEL`` elements or more, on
        CPU, is copied here, as it arrives.
        """
        bucket = self._bucket_of[index]
        self._log.logs[bucket].append(param)
        phase = self._phase
        if phase is not _Phase.REDUCING:
            if phase is not _Phase.EXPECT_SYNC:
                return  # no_sync or no DDP forward: read at the next forward
            # The backward did not pass through the module's outputs' nodes (the loss
            # was built from other tensors): start here; correct except when this
            # hook runs inside a reentrant checkpoint's nested backward.
            self._begin_reduction(self._generation)
        if self._discovering or bucket < self._next_bucket:
            return  # discovery launches everything at the end; a late piece is found there
        if self._eager[index]:
            fired = self._eager_fired[index] = self._eager_fired[index] + 1
            expected = self._expected[index]
            if fired >= expected:  # (fewer pieces than expected: more are coming)
                if fired > expected and self.gradient_as_bucket_view:
                    self._on_late_gradient(index, bucket, fired)  # it landed in the already averaged slice
                self._fill_now(index, bucket)  # again after an extra piece: the latest sum wins
        self._launch_ready_buckets()

    def _fill_now(self, index: int, bucket: int) -> None:
        """Copy a large gradient into its slice as it arrives (``EAGER_NUMEL``)."""
        position = self._position[index]
        divisor = self._fill_divisor()
        try:
            self.buckets[bucket].fill_one(position, divisor, self.gradient_as_bucket_view)
        except SparseGradient:
            raise self._sparse_error(index) from None
        self._filled[bucket].add(position)

    def _fill_divisor(self) -> float | None:
        """What gradients are divided by as they are copied into a bucket: the world size, unless the comm hook
        averages (then nothing)."""
        return self.divisor if self._divides and self.divisor != 1 else None

    def _sparse_error(self, index: int) -> RuntimeError:
        return RuntimeError(f"parameter {self.names[index]!r} has a sparse gradient; dptrain's DDP reduces dense "
                            "gradients only (use sparse=False)")

    def _on_late_gradient(self, index: int, bucket: int, piece: int) -> None:
        if self.gradient_as_bucket_view:
            # The piece was accumulated in place into the bucket slice, after that slice
            # was averaged (and perhaps while it is being all-reduced): it cannot be undone.
            raise RuntimeError(
                f"parameter {self.names[index]!r} received gradient piece #{piece} of "
                f"this backward, but the previous step led dptrain to expect "
                f"{self._expected[index]} and its bucket slice was already averaged: the graph "
                "changed between steps. Use gradient_as_bucket_view=False for dynamic graphs.")
        if not self.arrivals.can_agree_on_late():
            # [Note: ranks agree on late buckets] in arrivals.py: re-reducing on this rank
            # alone would desynchronise the ranks' collectives.
            reason = ("static_graph=True promised the same graph every step" if self.static_graph else
                      "no gradient arrived in pieces in the first step and find_unused_parameters is off")
            raise RuntimeError(
                f"parameter {self.names[index]!r} received a gradient after its bucket was reduced: the "
                f"graph changed between steps, and {reason}. Pass find_unused_parameters=True (and "
                "static_graph=False) for models whose graph changes.")
        self._stale.add(bucket)

    def _launch_ready_buckets(self) -> None:
        if self._discovering:
            return  # everything is launched at the end
        while self._next_bucket < len(self.buckets) and self._log.complete(self._next_bucket,
                                                                           self._want[self._next_bucket]):
            self._launch(self._next_bucket)
            self._stats.launched_during_backward += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        self._log.launched(b)
        self._handles.append(self._reduce(bucket))
        self._next_bucket = b + 1
        self._stats.launch_order.append(b)

    def _reduce(self, bucket: Bucket) -> tuple[ReduceHandle, list]:
        """Start reducing a bucket: copy its gradients in (averaged, unless the comm hook does it), then communicate.

        Returns the handle and the bucket's ``[index, launched, done]`` span, completed by :func:`_waited`.
        """
        try:
            bucket.fill(self._fill_divisor(), self.gradient_as_bucket_view, self._filled[bucket.index])
        except SparseGradient as e:
            raise self._sparse_error(bucket.param_indices[e.position]) from None
        stats = self._stats
        stats.calls += 1
        stats.bytes += bucket.nbytes
        stats.bucket_bytes.append(bucket.nbytes)
        span = [bucket.index, time.perf_counter(), None]
        stats.bucket_spans.append(span)
        return self._communicate(bucket, bucket.buffer), span

    def _communicate(self, bucket: Bucket, buffer: torch.Tensor) -> ReduceHandle:
        """Reduce ``buffer`` (the bucket's, or zeros of its layout) with the comm hook: the one way out.

        With a ``check``, the call's fingerprint is compared across ranks first (comm/fingerprint.py):
        on each bucket's first reduction, or on every one.
        """
        if self.check is not None:
            self.check.verify_site(bucket.index, self._check_op, [buffer], f"bucket {bucket.index}")
        self._stats.sent_bytes += self._sent_bytes[bucket.index]
        views = bucket.views if buffer is bucket.buffer else bucket.views_into(buffer)
        grad_bucket = GradBucket(bucket.index, buffer, views, bucket.params,
                                 is_last=(bucket.index == len(self.buckets) - 1))
        return self.comm_hook(self.comm_state, grad_bucket)

    # ------------------------------------------------------------------- finalize

    def _finalize(self) -> None:
        """End of the outermost backward: launch the rest, wait, write ``.grad``."""
        stats = self._stats
        stats.backward_end = time.perf_counter()
        try:
            while self._next_bucket < len(self.buckets):
                self._launch(self._next_bucket)
            fired = self._read_logs()
            late = [b in self._stale for b in range(len(self.buckets))]
            globally_used, late, sent = self.arrivals.exchange(self.process_group, late)
            stats.calls += sent > 0
            stats.bytes += sent
            if self.arrivals.discovering:
                stats.calls += 1
                stats.bytes += self.arrivals.learn_pieces(self.process_group, fired)
            everything_used = False not in globally_used  # True: write_back skips the per-parameter check
            # Wait and copy out bucket by bucket: bucket k's copy overlaps bucket k+1's
            # reduction. Every rank re-reduces the same (agreed) late buckets in order.
            for bucket, (handle, span) in zip(self.buckets, self._handles, strict=True):
                bucket.store(_waited(handle, span))
                if late[bucket.index]:
                    self._reduce_again(bucket)
                bucket.write_back(everything_used or globally_used, self.gradient_as_bucket_view)
                if self.bucket_optimizer is not None:  # overlaps the later buckets' reductions
                    started = time.perf_counter()
                    self.bucket_optimizer.step_bucket(bucket.params)
                    stats.optimizer_s += time.perf_counter() - started
            stats.comm_end = time.perf_counter()
            missing = [] if 0 not in fired else \
                [self.names[i] for i, n in enumerate(fired) if n == 0 and self._expected[i] > 0]
            self.arrivals.learn(fired, globally_used)
        finally:
            self.last_stats = stats
            self._phase = _Phase.IDLE
            self._finalized_through = self._generation
            self.arrivals.forget_used()
            self._log.clear()
            self._handles = []
        if missing and not (self.find_unused_parameters or self.static_graph):
            raise UnusedParametersError(unused_message(missing, dist.get_rank(self.process_group)))

    def _read_logs(self) -> list[int]:
        """End of backward, every bucket launched: pieces per parameter; late pieces handled; next triggers set.

        Used parameters go into the ``find_unused_parameters`` map.
        """
        fired, late = self._log.pieces(self._expected)
        for index, bucket, piece in late:
            self._on_late_gradient(index, bucket, piece)
        if self.arrivals.needs_used_map():  # a hook that fired with .grad None (an undefined gradient) used nothing
            self.arrivals.mark_used(i for i, n in enumerate(fired) if n and self.params[i].grad is not None)
        self._log.follow()
        return fired

    def _reduce_again(self, bucket: Bucket) -> None:
        self._filled[bucket.index] = set()  # copy every gradient in again, late pieces included
        bucket.store(_waited(*self._reduce(bucket)))

    def _reset_step(self) -> None:
        n = len(self.params)
        self._eager_fired = [0] * n                 # pieces of large CPU gradients (copied as they arrive)
        self._expected = [1] * n
        self._log.new_backward()
        self._next_bucket = 0
        self._filled: list[set[int]] = [set() for _ in self.buckets]  # positions copied in as they arrived
        self._handles: list[tuple[ReduceHandle, list]] = []  # per launched bucket: (handle, span)
        self._stale: set[int] = set()
        self._stats = StepCommStats()

    # ----------------------------------------------------------------- join support

    def reduce_zeros(self) -> None:
        """Shadow one synced backward with zero gradients (a rank out of data, see join.py).

        Fresh zero buffers, not the buckets' own: with ``gradient_as_bucket_view`` those
        are the parameters' ``.grad``.
        """
        handles = []
        for bucket in self.buckets:
            handles.append(self._communicate(bucket, torch.zeros_like(bucket.buffer)))
        for handle in handles:
            handle.wait()
        _, late, _ = self.arrivals.exchange(self.process_group, [False] * len(self.buckets), zeros=True)
        if self.arrivals.discovering:
            self.arrivals.learn_pieces(self.process_group, [], zeros=True)
            self.arrivals.last = [0] * len(self.params)  # discovery is over for every rank
        for bucket in self.buckets:
            if late[bucket.index]:  # the active ranks reduce it again: join them with zeros
                self._communicate(bucket, torch.zeros_like(bucket.buffer)).wait()


def _grad_hook_maker(reducer_ref: weakref.ref) -> Callable[[int], Callable[[torch.Tensor], None]]:
    """What makes parameter ``index``'s Python gradient hook, for the arrival log to keep and call again.

    [Note: nothing holds the reducer but its module]
    A deleted ``DistributedDataParallel`` frees its reducer, parameters, gradients and buckets at once, as
    torch's does, not at the garbage collector's next full collection (which may never come: a process that
    wraps a model again would carry the old one's memory). So the hooks, this maker and the backward callback
    reach the reducer through a weak reference (tests/test_ddp_lifetime.py).
    """

    def make(index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            reducer = reducer_ref()
            if reducer is not None:
                reducer._on_grad_accumulated(index, param)

        return hook

    return make


def _waited(handle: ReduceHandle, span: list) -> torch.Tensor:
    """Wait for a bucket's reduction and complete its span: exactly when the handle knows
    (``Work.completed_at``, the default hook with ``record_spans``), else now (an upper bound)."""
    result = handle.wait()
    if span[2] is None:
        span[2] = getattr(handle, "completed_at", None) or time.perf_counter()
    return result
