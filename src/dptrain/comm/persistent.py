"""Persistent all-reduce: one tensor's all-reduce, its arguments checked once, started every step.

MPI 4.0 calls this a persistent collective (``MPI_Allreduce_init`` once, ``MPI_Start``
per use; section 6.13): a program that reduces the same buffer every step pays for
argument checks and dispatch once, not every time. torch's C++ reducer launches DDP's
buckets the same way: a direct call to the process group's ``allreduce``, no checks between.

:class:`PersistentAllReduce` checks the tensor, group, algorithm and op as
:func:`dptrain.comm.all_reduce` does (and with ``validate=True`` agrees on them across
ranks, once, as a collective), then :meth:`~PersistentAllReduce.start` issues the
backend's all-reduce through ``ProcessGroup.allreduce`` with prepared options: on 2 gloo
ranks a launch costs the caller 13-28 us that way against 45-56 us through
``dptrain.comm.all_reduce`` (18-25 us through ``dist.all_reduce``, 10-15 us for the
process group's call alone; hot, back to back, ``torchrun --nproc-per-node 2
docs/repro/launch_cost.py``), and more inside backward, where the interpreter runs cold
(docs/benchmarks.md, "A bucket's life"). The other algorithms, and a call seen by a
torch function mode (``torch.export``, a mode of the user's), start through
:func:`~dptrain.comm.all_reduce`, unchanged.

The tensor is the one given: its storage is reduced in place every start. Start
it on every rank in the same order, as any collective. Not for use inside
``torch.distributed``'s coalescing manager, which only ``dist.all_reduce`` knows of.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from dptrain.comm.collectives import all_reduce, check_all_reduce
from dptrain.comm.wire import Traffic
from dptrain.comm.work import Work

__all__ = ["PersistentAllReduce"]


class PersistentAllReduce:
    """``all_reduce(tensor, op, ...)``, prepared once; :meth:`start` returns the running :class:`Work`.

    ``wait()`` returns ``tensor``, summed (``op="sum"``) or averaged (``"avg"``) over the
    group. A non-contiguous tensor is refused (there is no buffer to reduce in place).
    """

    def __init__(self, tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "native",
                 group: dist.ProcessGroup | None = None, nodes: int | Sequence[Sequence[int]] | None = None,
                 traffic: Traffic | None = None, validate: bool = True):
        contiguous = None if tensor.is_contiguous() else (
            f"tensor (shape {tuple(tensor.shape)}, strides {tensor.stride()}) is not contiguous; a persistent "
            "all-reduce reduces one buffer in place: pass tensor.contiguous() and read the result from it")
        self.group, self.world_size, self.op = check_all_reduce(tensor, op, algorithm=algorithm, group=group,
                                                                nodes=nodes, validate=validate, problem=contiguous)
        self.tensor, self.algorithm, self.nodes, self.traffic = tensor, algorithm, nodes, traffic
        self._args = (tensor,)
        self._list = [tensor.detach()]
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.SUM
        self._opts.asyncOp = True
        self._alone = self.world_size == 1 or tensor.numel() == 0  # nothing to communicate
        self._direct = algorithm == "native"

    def start(self, timed: bool = False) -> Work:
        """Issue the all-reduce; ``timed``: stamp ``Work.completed_at`` exactly (a callback on the backend's
        thread), else when waited for."""
        if self._alone:
            return Work.completed(self._result)
        if not self._direct or has_torch_function(self._args):
            return all_reduce(self.tensor, self.op, algorithm=self.algorithm, group=self.group, nodes=self.nodes,
                              traffic=self.traffic, async_op=True, validate=False, timed=timed)
        return Work(self._result, backend_work=self.group.allreduce(self._list, self._opts), timed=timed)

    def _result(self) -> torch.Tensor:
        if self.op == "avg":
            self.tensor.div_(self.world_size)
        return self.tensor
