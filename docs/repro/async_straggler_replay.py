"""Async PS with a 2x straggler, replayed in one process: three rules for stale gradients (docs/async.md).

    python docs/repro/async_straggler_replay.py --rule plain        # Dean et al. 2012: lr / workers
    python docs/repro/async_straggler_replay.py --rule staleness    # Zhang et al. 2016: also / max(1, delay)
    python docs/repro/async_straggler_replay.py --rule lookahead    # dptrain.ps.Lookahead (DANA-style)

An event-driven replay of the async parameter server's rule: ``--workers`` workers, the
last one ``--slow`` times slower, each computing a gradient on batches of 16 at the
parameters it last read; the server applies every gradient on arrival with AdamW at
``warmup_cosine(updates // workers) / workers`` after clipping at 1.0, and answers the
worker. With ``lookahead`` the answer is ``Lookahead.predict`` of the server's own
class. Same data, seed and budget (100 steps x workers gradients) for every rule; the
synchronous reference (DDP, 100 steps of 16 per worker) ends at 2.2468 (2 workers) and
2.3023 (4) in ``dptrain bench async``. Prints the validation loss on the study's 256 samples and the delay histogram.
"""

from __future__ import annotations

import argparse
import copy
import heapq
from collections import Counter

import torch
from async_delay import study_val_loss  # beside this file
from torch import nn

from dptrain.config import load_config
from dptrain.optim.build import build_optimizer
from dptrain.optim.schedule import warmup_cosine
from dptrain.ps.lookahead import Lookahead
from dptrain.tasks import build_task


def _as_flat_views(model: nn.Module) -> tuple[torch.Tensor, nn.ParameterList]:
    """Make the model's parameters views of one flat buffer, as a server holds them."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    offset = 0
    for p in model.parameters():
        p.data = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
    return flat, nn.ParameterList(model.parameters())


def replay(rule: str, lr: float = 2e-3, steps: int = 100, workers: int = 2, slow: float = 2.0) -> tuple[float, Counter]:
    task = build_task(load_config(None, []))
    torch.manual_seed(0)
    model = task.build_model()
    flat, params = _as_flat_views(model)
    optimizer = build_optimizer(model, "adamw", lr, 0.1, (0.9, 0.99), 0.9)
    lookahead = Lookahead(optimizer, params, flat, list(range(workers))) if rule == "lookahead" else None
    replicas = [copy.deepcopy(model) for _ in range(workers)]
    read_version = [0] * workers
    speed = [1.0] * (workers - 1) + [slow]
    arrivals = [(speed[w], w) for w in range(workers)]  # (time the gradient arrives, worker)
    heapq.heapify(arrivals)
    g = torch.Generator().manual_seed(0)
    delays: Counter = Counter()
    for version in range(steps * workers):
        now, w = heapq.heappop(arrivals)
        idx = torch.randint(0, len(task.train_set), (16,), generator=g).tolist()
        replicas[w].zero_grad()
        task.loss(replicas[w], torch.utils.data.default_collate([task.train_set[i] for i in idx])).backward()
        for p, r in zip(model.parameters(), replicas[w].parameters(), strict=True):
            p.grad = r.grad.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        delay = version - read_version[w]
        delays[delay] += 1
        step_lr = warmup_cosine(version // workers, lr, 30, steps, 0.1) / workers
        if rule == "staleness":
            step_lr /= max(1, delay)
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        optimizer.step()
        optimizer.zero_grad()
        sent = flat
        if lookahead:
            lookahead.observe(w, delay)
            next_lr = warmup_cosine((version + 1) // workers, lr, 30, steps, 0.1) / workers
            sent = lookahead.predict(w, next_lr, version + 1)
        with torch.no_grad():  # a copy: the replica must not share the server's memory
            offset = 0
            for r in replicas[w].parameters():
                r.copy_(sent[offset:offset + r.numel()].view(r.shape))
                offset += r.numel()
        read_version[w] = version + 1
        heapq.heappush(arrivals, (now + speed[w], w))
    return study_val_loss(task, model), delays


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rule", choices=["plain", "staleness", "lookahead"], default="plain")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slow", type=float, default=2.0, help="how many times slower the last worker is")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (the default task's)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    loss, delays = replay(a.rule, a.lr, workers=a.workers, slow=a.slow)
    sync = {2: 2.2468, 4: 2.3023}.get(a.workers)  # DDP's in dptrain bench async, same budget
    versus = f" ({loss / sync:.4f}x sync's {sync})" if sync and a.slow == 2.0 and a.lr == 2e-3 else ""
    print(f"rule {a.rule}, {a.workers} workers, lr {a.lr:g}: val loss {loss:.4f}{versus}; "
          f"delays {dict(sorted(delays.items()))}")
