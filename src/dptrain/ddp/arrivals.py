"""Which gradients to wait for: expected arrivals per parameter, and who used what.

A bucket can be reduced once every gradient in it is complete, so the reducer needs to
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
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from dptrain.ddp.autograd import reachable_params

__all__ = ["GradientArrivals"]


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
