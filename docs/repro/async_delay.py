"""What a one-update delay does to AdamW on the default task, in one process (docs/async.md, "The study").

    python docs/repro/async_delay.py --delay 0 --beta1 0.9     # fresh gradients
    python docs/repro/async_delay.py --delay 1 --beta1 0.9     # taken one update late

This reproduces the async parameter server's rule for 2 workers without a server: 200
updates (100 synchronous steps x 2 workers) on batches of 16, the learning rate of
``warmup_cosine(update // 2) / 2``, clipping at 1.0. Each gradient is taken at the
parameters of ``--delay`` updates ago, which is what async PS's workers do when
arrivals alternate. Everything else is equal, so the difference between the two
commands is the cost of the delay. Prints the validation loss on the same 256 samples
every variant of the study is evaluated on (the first 16 x 16 of the validation split).
"""

from __future__ import annotations

import argparse
import copy

import torch

from dptrain.config import load_config
from dptrain.optim.build import build_optimizer
from dptrain.optim.schedule import warmup_cosine
from dptrain.tasks import build_task


def train(delay: int, beta1: float, lr: float = 2e-3, steps: int = 100, workers: int = 2) -> float:
    task = build_task(load_config(None, []))
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = build_optimizer(model, "adamw", lr, 0.1, (beta1, 0.99), 0.9)
    stale = copy.deepcopy(model)  # where gradients are taken: the parameters of `delay` updates ago
    history = [[p.detach().clone() for p in model.parameters()]]
    g = torch.Generator().manual_seed(0)
    for update in range(steps * workers):
        idx = torch.randint(0, len(task.train_set), (16,), generator=g).tolist()
        batch = torch.utils.data.default_collate([task.train_set[i] for i in idx])
        with torch.no_grad():
            for p, old in zip(stale.parameters(), history[max(0, len(history) - 1 - delay)], strict=True):
                p.copy_(old)
        stale.zero_grad()
        task.loss(stale, batch).backward()
        for p, s in zip(model.parameters(), stale.parameters(), strict=True):
            p.grad = s.grad.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(update // workers, lr, 30, steps, 0.1) / workers
        optimizer.step()
        optimizer.zero_grad()
        history = (history + [[p.detach().clone() for p in model.parameters()]])[-(delay + 2):]
    return study_val_loss(task, model)


def study_val_loss(task, model) -> float:
    """Mean validation loss on the first 256 samples of the validation split, as the study evaluates."""
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, 256, 16):
            sums = task.eval_sums(model, torch.utils.data.default_collate([task.val_set[j] for j in range(i, i + 16)]))
            total, count = total + sums["loss_sum"], count + sums["count"]
    return total / count


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=int, default=1)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (the default task's)")
    a = parser.parse_args()
    print(f"delay {a.delay}, beta1 {a.beta1}, lr {a.lr:g}: val loss {train(a.delay, a.beta1, a.lr):.4f}")
