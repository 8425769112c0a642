"""Arrival logs: which gradients a backward has accumulated, per bucket, without Python per parameter.

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
from typing import Any, Callable

import torch

from dptrain.ddp.buckets import Bucket

__all__ = ["ArrivalLog", "Want"]


class Want:
    """What completes a bucket: its parameters' expected gradient pieces."""

    __slots__ = ("pieces", "counts", "ids")

    def __init__(self, counts: dict[int, int]):
        self.counts = counts                  # id(param) -> expected pieces, for parameters expecting any
        self.pieces = sum(counts.values())
        self.ids = set(counts) if all(c == 1 for c in counts.values()) else None  # the usual case

    @classmethod
    def of(cls, bucket: Bucket, expected: list[int]) -> "Want":
        return cls({id(p): expected[i] for i, p in zip(bucket.param_indices, bucket.params) if expected[i]})

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
        if all(self._exact) and all(len(log) == n for log, n in zip(self.logs, self._launched_at)):
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
