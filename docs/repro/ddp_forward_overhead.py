"""Per-step overhead of the wrapper on a tiny model (world size 1): min over repeats of the mean step time."""
import os
import sys
import timeit

import torch
import torch.distributed as dist
from torch import nn

os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ["MASTER_PORT"] = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
import dptrain

torch.manual_seed(0)
m = nn.Linear(4, 4)
ddp = dptrain.DistributedDataParallel(m)
x = torch.randn(2, 4)
def fwd():
    ddp(x)
def step():
    ddp(x).sum().backward()
for f in (fwd, step): f()
res = {}
for name, f in (("forward (no_grad)", fwd), ("forward+backward", step)):
    if name.startswith("forward (no"):
        with torch.no_grad():
            t = min(timeit.repeat(f, number=2000, repeat=7)) / 2000
    else:
        t = min(timeit.repeat(f, number=500, repeat=7)) / 500
    res[name] = t * 1e6
print(dptrain.__file__.split("/src/")[0], " ".join(f"{k}: {v:.1f} us" for k, v in res.items()))
