"""Gradient arrival bookkeeping: which gradients a backward waits for, and which have come.

Two halves. :class:`GradientArrivals` decides, before backward, how many pieces of
each parameter's gradient to expect and, after it, which parameters any rank used;
:class:`ArrivalLog` records, during backward, which gradients arrived in each bucket,
without a Python frame per parameter, and tells the reducer when a bucket is complete.

Expected arrivals. A bucket can be reduced once every gradient in it is complete, so the reducer needs to
know, before backward starts, how many times each parameter's gradient will be
accumulated. Usually once; zero for a parameter that is not used this step; more than
once under reentrant activation checkpointing, where a weight shared by k checkpointed
segments receives k separate pieces (one per nested backward). No rule predicts the
last case from the module, so the counts are *learned*: the first synced backward is a
discovery pass that only records them, and each step expects what the previous one
saw (torch's static-graph mode keeps similar per-parameter counts).

Unused parameters are found three ways: the ``find_unused_parameters`` walk over the
autograd graph from the outputs (torch's method; blind to parameters behind a
reentrant checkpoint, so trusted only for parameters that also got nothing last step);
a static graph's first step; and, after backward, an all-reduced map of which
parameters any rank used since the last sync, so that parameters no rank used keep
``.grad`` untouched, exactly as in a single process.

[Note: ranks agree on late buckets]
When the graph changes between steps, a gradient piece can arrive after its bucket was
launched; the reducer then reduces that bucket again. Ranks must issue the same extra
all-reduces, so the flags of such "late" buckets are all-reduced together with the used
map, and every rank re-reduces the union. The exchange happens every step with
``find_unused_parameters``, and also without it when the discovery pass saw a gradient
arrive in pieces on any rank (reentrant checkpointing with shared weights: the number
of pieces may change), which one all-reduce after the first step establishes. In the
remaining case (single-piece gradients, no unused parameters) a late piece cannot be
agreed on and the reducer raises instead.

[Note: arrival logs]
A Python gradient hook costs about 0.55 us per parameter in autograd's machinery even
when it does nothing, and one that counts arrivals and finds its bucket about 0.6 us
more (``python docs/repro/ddp_small_params.py hooks``): on a model of 800 small tensors
about 3% of a step at world size 2, most of dptrain's gap to torch's reducer there
(docs/benchmarks.md). So the count is not kept per parameter. Each bucket has a log, a
list of the parameters whose gradients were accumulated, in arrival order, and most
parameters' post-accumulate-grad hook *is* their log's ``append``, a C function:
autograd runs no Python frame for them. One parameter per bucket, its *trigger* (the
one that arrived last in the previous step), has the reducer's Python hook, which asks
whether the bucket is complete: whether its log holds exactly the expected gradients
(one ``set`` of ``id``s compared, in C). If the order changes and the trigger fires
before the others, the bucket waits for the next trigger or the end of backward:
later, never wrong. The end of backward reads the logs once: pieces per parameter (only
when some bucket's log was not exactly as expected), gradients that arrived after their
bucket was launched, and the next step's triggers. A ``no_sync`` backward's logs are
read at the next forward, and only for what ``find_unused_parameters`` needs.

A backward must start the reduction: normally the forward's outputs' nodes do it
(``autograd.py``), otherwise a trigger's hook. A backward after a synced forward that
reaches neither (a loss built from a few parameters, not from the outputs) would leave
gradients unaveraged; the next forward finds them in the logs and the reducer raises.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from dptrain.ddp.autograd import reachable_params
from dptrain.ddp.buckets import Bucket

__all__ = ["GradientArrivals", "ArrivalLog", "Want", "UnusedParametersError", "unused_message"]


class GradientArrivals:
    def __init__(self, params: list[torch.nn.Parameter], find_unused_parameters: bool, static_graph: bool):
        self.params = params
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.last: list[int] | None = None          # arrivals in the last synced backward
        self.static_unused: set[int] | None = None   # static graph: globally unused, learned
        self.locally_used = [False] * len(params)    # since the last sync (spans no_sync); the reducer's hook sets it
        self.pieces_vary = False                      # some rank saw a gradient in pieces

    @property
    def discovering(self) -> bool:
        """True until the first synced backward has been seen."""
        return self.last is None

    def expected(self, outputs: list[torch.Tensor]) -> list[int]:
        """Gradient pieces to wait for per parameter in the backward of ``outputs``."""
        last, n = self.last, len(self.params)
        if last is None:
            return [0 if i in self._unreachable(outputs, last) else 1 for i in range(n)]
        if self.static_graph and self.static_unused is not None:
            return [0 if i in self.static_unused else max(1, last[i]) for i in range(n)]
        unused = self._unreachable(outputs, last)
        return [0 if i in unused else max(1, last[i]) for i in range(n)]

    def _unreachable(self, outputs: list[torch.Tensor], last: list[int] | None) -> set[int]:
        if not self.find_unused_parameters or self.static_graph:
            return set()
        reached = reachable_params(outputs)
        # Parameters behind a reentrant checkpoint are invisible to the graph walk;
        # trust the walk only for those that got no gradient last step either.
        return {i for i, p in enumerate(self.params)
                if id(p) not in reached and (last is None or last[i] == 0)}

    def mark_used(self, indices: Iterable[int]) -> None:
        """Record parameters whose gradients arrived since the last sync (for :meth:`exchange`)."""
        for i in indices:
            self.locally_used[i] = True

    def needs_used_map(self) -> bool:
        """Whether this step must all-reduce the map of used parameters."""
        return self.find_unused_parameters or (self.static_graph and self.static_unused is None)

    def can_agree_on_late(self) -> bool:
        """Whether this step's exchange carries late-bucket flags (see the note above)."""
        return self.needs_used_map() or self.pieces_vary

    def exchange(self, group: dist.ProcessGroup, late: list[bool],
                 zeros: bool = False) -> tuple[list[bool], list[bool], int]:
        """Agree on (used parameters, late buckets); also return the bytes sent.

        ``zeros=True`` contributes nothing used and nothing late (a rank shadowing a step
        it has no data for). Every rank calls this at the same point and decides on the
        same grounds whether to communicate at all.
        """
        n = len(self.params)
        if not self.can_agree_on_late():
            return self._known_used(), list(late), 0
        local = [0] * (n + len(late)) if zeros else [int(u) for u in self.locally_used] + [int(x) for x in late]
        flags = torch.tensor(local, dtype=torch.int32, device=self.params[0].device)
        dist.all_reduce(flags, group=group)
        summed = flags.tolist()
        used = [u > 0 for u in summed[:n]] if self.needs_used_map() else self._known_used()
        return used, [x > 0 for x in summed[n:]], flags.numel() * flags.element_size()

    def _known_used(self) -> list[bool]:
        if self.static_unused is not None:
            return [i not in self.static_unused for i in range(len(self.params))]
        return [True] * len(self.params)

    def learn_pieces(self, group: dist.ProcessGroup, fired: list[int], zeros: bool = False) -> int:
        """After the discovery pass: did any rank see a gradient arrive in pieces? Bytes sent."""
        most = torch.tensor([0 if zeros else max(fired, default=0)], dtype=torch.int32,
                            device=self.params[0].device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        self.pieces_vary = int(most.item()) > 1
        return most.numel() * most.element_size()

    def learn(self, fired: list[int], globally_used: list[bool]) -> None:
        """Record this backward's arrivals as the next step's expectations."""
        self.last = list(fired)
        if self.static_graph and self.static_unused is None:
            self.static_unused = {i for i, used in enumerate(globally_used) if not used}

    def forget_used(self) -> None:
        """A sync happened (or failed): start a new record of what this rank used."""
        self.locally_used = [False] * len(self.params)



class Want:
    """What completes a bucket: its parameters' expected gradient pieces."""

    __slots__ = ("pieces", "counts", "ids")

    def __init__(self, counts: dict[int, int]):
        self.counts = counts                  # id(param) -> expected pieces, for parameters expecting any
        self.pieces = sum(counts.values())
        self.ids = set(counts) if all(c == 1 for c in counts.values()) else None  # the usual case

    @classmethod
    def of(cls, bucket: Bucket, expected: list[int]) -> Want:
        return cls({id(p): expected[i] for i, p in zip(bucket.param_indices, bucket.params, strict=True) if expected[i]})

    def met_by(self, log: list[torch.Tensor]) -> bool | None:
        """None: ``log`` lacks an expected piece; True: it is exactly the expected pieces; False: more."""
        n = len(log)
        if n < self.pieces:
            return None
        if n == self.pieces and self.ids is not None:
            return True if set(map(id, log)) == self.ids else None
        got = collections.Counter(map(id, log))
        if any(got[k] < c for k, c in self.counts.items()):
            return None
        return n == self.pieces


class ArrivalLog:
    """Per bucket, the parameters whose gradients this backward accumulated, and the hooks that log them.

    ``python_hook(index)`` makes the Python hook of parameter ``index``, given to each
    bucket's trigger and to every parameter ``always_python`` marks; the others log
    through their bucket log's ``append``.
    """

    def __init__(self, params: list[torch.nn.Parameter], bucket_indices: list[list[int]],
                 python_hook: Callable[[int], Callable[[torch.Tensor], None]], always_python: list[bool]):
        self.params = params
        self.logs: list[list[torch.Tensor]] = [[] for _ in bucket_indices]
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self._bucket_of = {i: b for b, indices in enumerate(bucket_indices) for i in indices}
        self._triggers = [indices[-1] for indices in bucket_indices]  # expected last in each bucket
        self._python_hook, self._always_python = python_hook, always_python
        self._handles = [self._register(i) for i in range(len(params))]
        self.new_backward()

    def _register(self, index: int) -> Any:
        bucket = self._bucket_of[index]
        python = self._always_python[index] or self._triggers[bucket] == index
        hook = self._python_hook(index) if python else self.logs[bucket].append
        return self.params[index].register_post_accumulate_grad_hook(hook)

    def new_backward(self) -> None:
        self._exact = [False] * len(self.logs)      # launched with its log exactly as expected
        self._launched_at = [0] * len(self.logs)    # log length at launch: later entries are late pieces

    # ------------------------------------------------------------------ during backward

    def complete(self, bucket: int, want: Want) -> bool:
        """Whether ``bucket``'s log holds every expected piece (remembering whether exactly those)."""
        exact = want.met_by(self.logs[bucket])
        if exact is None:
            return False
        self._exact[bucket] = exact
        return True

    def launched(self, bucket: int) -> None:
        self._launched_at[bucket] = len(self.logs[bucket])

    # ------------------------------------------------------------------ after backward

    def is_empty(self) -> bool:
        return not any(self.logs)

    def indices(self) -> list[int]:
        """The parameter index of every entry, bucket by bucket, in arrival order."""
        index_of = self.index_of
        return [index_of[id(p)] for log in self.logs for p in log]

    def pieces(self, expected: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Every bucket launched: (pieces per parameter, late pieces as (index, bucket, piece number)).

        Pieces are ``expected`` itself when every bucket's log was exactly what completed
        it and nothing came after its launch (the usual step: no loop over parameters);
        otherwise counted from the logs.
        """
        if all(self._exact) and all(len(log) == n for log, n in zip(self.logs, self._launched_at, strict=True)):
            return expected, []
        fired, late = [0] * len(self.params), []
        for b, log in enumerate(self.logs):
            for position, param in enumerate(log):
                index = self.index_of[id(param)]
                fired[index] += 1
                if position >= self._launched_at[b]:
                    late.append((index, b, fired[index]))
        return fired, late

    def follow(self) -> None:
        """Make each bucket's last arrival of this backward its trigger for the next."""
        for b, log in enumerate(self.logs):
            if log and log[-1] is not self.params[self._triggers[b]]:
                old, new = self._triggers[b], self.index_of[id(log[-1])]
                self._triggers[b] = new
                for i in (old, new):
                    self._handles[i].remove()
                    self._handles[i] = self._register(i)

    def clear(self) -> None:
        for log in self.logs:
            log.clear()  # in place: the hooks hold the lists' append


class UnusedParametersError(RuntimeError):
    """Some parameters received no gradient while ``find_unused_parameters=False``."""


def unused_message(missing: list[str], rank: int) -> str:
    """What a rank says about ``missing`` (parameters without a gradient): the fix included."""
    shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
    return (
        f"rank {rank}: {len(missing)} parameter(s) received no gradient in this backward "
        f"pass: {shown}. Their buckets were still reduced (with zeros), so no rank hangs, "
        "but gradients of unused parameters are ambiguous. If the model uses different "
        "parameters on different steps or ranks, pass find_unused_parameters=True (or "
        "static_graph=True if the set never changes); otherwise make sure every output "
        "that depends on these parameters contributes to the loss.")
