"""A loop on dptrain's Engine with live recovery (tests/test_live_loop.py): replica R dies at the start of step S in
its first life (``--kill R:S``); every replica prints its step count and learning rate at the end."""

import argparse
import os
import signal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dptrain

parser = argparse.ArgumentParser()
parser.add_argument("--kill", required=True)
args = parser.parse_args()
kill = tuple(map(int, args.kill.split(":")))

dptrain.init_distributed()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
plan = dptrain.BatchPlan.resolve(1, micro_batch_size=8, grad_accum_steps=2)
engine = dptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan,
                        lr_at=lambda s: dptrain.warmup_cosine(s, 3e-3, 2, 8, 0.1))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 8, (256,), generator=g))
live = dptrain.Live(engine, steps=8, dataset=data, check_every=1)
for r in live:
    if (live.replica, r.step) == kill and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    for x, y in engine.micro_steps(iter(r.batches())):
        engine.backward(F.cross_entropy(engine.model(x), y))
    r.commit()
print(f"replica {live.replica}: step {live.step}, engine {engine.step_count}, "
      f"lr {engine.optimizer.param_groups[0]['lr']:.6e}", flush=True)
