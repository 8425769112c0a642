"""PersistentAllReduce: prepared once, started again and again, the same result as ``all_reduce`` each time."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dptrain import comm
from dptrain.ddp.comm_hooks import GradBucket, SumAllReduce
from dptrain.testing import run_on_ranks


def _started_repeatedly(rank: int, world_size: int) -> dict:
    out = {}
    for algorithm in ("native", "ring"):
        for op in ("sum", "avg"):
            x = torch.zeros(7)
            prepared = comm.PersistentAllReduce(x, op, algorithm=algorithm)  # validate=True: agrees once
            got = []
            for step in range(3):
                x.copy_(torch.arange(7.0) * (rank + 1) + step)  # new contents, same storage
                want = x.clone()
                dist.all_reduce(want)
                if op == "avg":
                    want /= world_size
                result = prepared.start(timed=step == 1).wait()
                got.append((result is x, torch.equal(x, want)))
            out[f"{algorithm}/{op}"] = got
    calls = []
    real = dist.all_reduce
    dist.all_reduce = _refuse  # the native route calls the process group itself, not dist.all_reduce
    try:
        with _Calls(calls):  # one backend all-reduce per start, of the tensor itself
            y = torch.ones(5)
            prepared = comm.PersistentAllReduce(y, validate=False)
            prepared.start().wait()
            prepared.start().wait()
        empty = comm.PersistentAllReduce(torch.zeros(0), validate=False)
        out["empty"] = empty.start().wait().numel()
    finally:
        dist.all_reduce = real
    # the DDP engine's default hook: its buckets' buffers prepared, any other buffer (a joined rank's zeros)
    # reduced once and not kept
    hook = SumAllReduce(dist.group.WORLD)
    own = torch.full((3,), float(rank))
    hook.prepare([own])
    zeros = torch.zeros(3)
    results = [hook(None, GradBucket(0, b, [b], [b], True)).wait().tolist() for b in (own, zeros, own)]
    out["hook"] = (results, hook._prepared[0].tensor is own)
    out["native calls"] = calls
    out["pointer"] = calls[0] == y.data_ptr() if calls else None
    try:
        comm.PersistentAllReduce(torch.zeros(4, 4).t(), validate=False)
    except ValueError as error:
        out["non-contiguous"] = str(error)
    return out


def _refuse(*args, **kwargs):
    raise AssertionError("dist.all_reduce was called")


class _Calls(TorchDispatchMode):
    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) == "c10d.allreduce_.default":
            self.calls += [t.data_ptr() for t in args[0]]
        return func(*args, **(kwargs or {}))


def test_persistent_all_reduce_matches_all_reduce_every_start() -> None:
    for rank, out in enumerate(run_on_ranks(_started_repeatedly, 2)):
        for route in ("native/sum", "native/avg", "ring/sum", "ring/avg"):
            assert out[route] == [(True, True)] * 3, (rank, route, out[route])
        assert len(out["native calls"]) == 2 and out["pointer"], out["native calls"]
        assert out["empty"] == 0
        # rank 0's own [0, 0, 0] plus rank 1's [1, 1, 1]; zeros; then own again (it holds the first sum)
        assert out["hook"] == ([[1.0] * 3, [0.0] * 3, [2.0] * 3], True), out["hook"]
        assert "not contiguous" in out["non-contiguous"] and "tensor.contiguous()" in out["non-contiguous"]


def _one_rank(rank: int, world_size: int) -> dict:
    x = torch.arange(3.0)
    result = comm.PersistentAllReduce(x, "avg").start().wait()  # nothing to communicate: x as it was
    errors = {}
    for name, args in {"op": (torch.zeros(2), "max"), "dtype": (torch.zeros(2, dtype=torch.complex64),),
                       "algorithm": (torch.zeros(2), "sum")}.items():
        try:
            comm.PersistentAllReduce(*args, algorithm="rign" if name == "algorithm" else "native")
        except ValueError as error:
            errors[name] = str(error)
    return {"same": result is x and x.tolist() == [0.0, 1.0, 2.0], "errors": errors}


def test_persistent_all_reduce_refuses_what_all_reduce_refuses_on_one_rank() -> None:
    (out,) = run_on_ranks(_one_rank, 1)
    assert out["same"]
    assert "'max'" in out["errors"]["op"]
    assert "complex64" in out["errors"]["dtype"]
    assert "did you mean 'ring'" in out["errors"]["algorithm"]


def _mismatched(rank: int, world_size: int) -> str:
    try:
        comm.PersistentAllReduce(torch.zeros(3 + rank))
    except comm.CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_persistent_all_reduce_agrees_on_arguments_across_ranks() -> None:
    for message in run_on_ranks(_mismatched, 2):
        assert "length" in message and "rank 0: 3" in message and "rank 1: 4" in message, message
