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
"""

from __future__ import annotations

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
        self.locally_used = [False] * len(params)    # since the last sync (spans no_sync)

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

    def needs_used_map(self) -> bool:
        """Whether this step must all-reduce the map of used parameters."""
        return self.find_unused_parameters or (self.static_graph and self.static_unused is None)

    def globally_used(self, group: dist.ProcessGroup, zeros: bool = False) -> tuple[list[bool], int]:
        """Which parameters some rank used since the last sync, and the bytes exchanged.

        ``zeros=True`` contributes an all-unused map (a rank shadowing a step it has no
        data for). Every rank calls this at the same point, so the exchange is skipped
        on all of them together when no map is needed.
        """
        if not self.needs_used_map():
            if self.static_unused is not None:
                return [i not in self.static_unused for i in range(len(self.params))], 0
            return [True] * len(self.params), 0
        used = torch.tensor([0] * len(self.params) if zeros else self.locally_used,
                            dtype=torch.int32, device=self.params[0].device)
        dist.all_reduce(used, group=group)
        return (used > 0).tolist(), used.numel() * used.element_size()

    def learn(self, fired: list[int], globally_used: list[bool]) -> None:
        """Record this backward's arrivals as the next step's expectations."""
        self.last = list(fired)
        if self.static_graph and self.static_unused is None:
            self.static_unused = {i for i, used in enumerate(globally_used) if not used}

    def mark_used(self, index: int) -> None:
        self.locally_used[index] = True

    def forget_used(self) -> None:
        """A sync happened (or failed): start a new record of what this rank used."""
        self.locally_used = [False] * len(self.params)
