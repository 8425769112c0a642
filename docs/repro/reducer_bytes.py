"""The bytes each reducer's ops write in one step (docs/benchmarks.md, "A bucket's life against torch's reducer"):
issue 38's feed-forward MLP on one rank, forward and backward, without DDP, under torch's DDP and under dptrain's
(1 MiB buckets), every aten op counted by a TorchDispatchMode (which sees the C++ reducer's ops too): per op, its
calls and the MiB of its output (an in-place op's: its first argument's).

    python docs/repro/reducer_bytes.py
"""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dptrain.bench.ddp_models import build_model
from dptrain.ddp import DistributedDataParallel
from dptrain.testing import run_on_ranks


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls, self.bytes = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls[name] += 1
        self.bytes[name] += _nbytes(args[0] if name.endswith("_") else out)
        return out


def _step_ops(rank: int, world_size: int, which: str) -> list[tuple[str, int, float]]:
    torch.manual_seed(0)
    model = build_model(512, 8, "mlp-ffn")
    if which == "torch":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    elif which == "dptrain":
        model = DistributedDataParallel(model, bucket_cap_mb=1)
    x = torch.randn(32, 512)
    for _ in range(3):
        model(x).sum().backward()
    count = Count()
    with count:
        model(x).sum().backward()
    return sorted(((k, count.calls[k], round(count.bytes[k] / 2**20, 1)) for k in count.calls), key=lambda t: -t[2])


if __name__ == "__main__":
    for which in ("no DDP", "torch", "dptrain"):
        print(which)
        for name, calls, mib in run_on_ranks(_step_ops, 1, which)[0][:10]:
            print(f"  {name:16s} {calls:4d} calls {mib:8.1f} MiB")
