"""A user's own training loop on ``prepare()`` and ``dptrain.Live``, for the live study's ``loop`` variants.

``python -m dptrain.bench.live_loop --steps N`` trains what ``dptrain run`` trains by
default (the config's GPT on the standard library's bytes, its global batch split over the
job's workers, AdamW at the config's learning rate, no schedule) with the loop a user writes
(:mod:`dptrain.api.live`): for each round, this member's micro-batches, forward, backward,
``r.commit()``. The study (:mod:`dptrain.bench.live`) starts one per emulated host under
``dptrain cluster --live-restarts`` and kills them as it kills ``dptrain run``'s workers;
its records are the same ``logs/live<r>.jsonl`` in ``$DPTRAIN_RUN_DIR``. Replica 0 writes
``final.json``: the steps and the validation loss on the study's samples (4 x 8 micro-batches
of 8).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import dptrain
from dptrain.config import load_config
from dptrain.runner.validate import DEFAULT_GLOBAL_BATCH
from dptrain.tasks import build_task

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args(argv)
    cfg = load_config(None, [])
    task = build_task(cfg)
    device = dptrain.init_distributed()  # this worker alone: the rounds span the job
    torch.manual_seed(cfg.train.seed)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    model, optimizer = dptrain.prepare(model, optimizer, device=device, grad_clip=cfg.train.grad_clip)
    replicas = int(os.environ.get("DPTRAIN_REPLICAS") or os.environ.get("WORLD_SIZE", "1"))  # one launch per host,
    # or one for the job (dptrain launch --live-restarts)
    live = dptrain.Live(model, optimizer, steps=args.steps, dataset=task.train_set,
                        batch_size=(cfg.train.global_batch_size or DEFAULT_GLOBAL_BATCH) // replicas, seed=cfg.train.seed,
                        check_every=cfg.live.check_every)
    for r in live:
        for batch in r.batches():
            task.loss(model, batch).backward()
        r.commit()
    if live.replica == 0:
        _write_final(Path(os.environ["DPTRAIN_RUN_DIR"]), model.module, task, live.step, device)


@torch.no_grad()
def _write_final(run_dir: Path, model: torch.nn.Module, task, steps: int, device: torch.device) -> None:
    """The validation loss on the study's samples (its first 32 windows, in batches of 8), beside the steps."""
    model.eval()
    sums = {"loss_sum": 0.0, "count": 0.0}
    for i in range(4):
        batch = torch.utils.data.default_collate([task.val_set[j] for j in range(8 * i, 8 * i + 8)])
        for key, value in task.eval_sums(model, [t.to(device) for t in batch]).items():
            sums[key] += value
    (run_dir / "final.json").write_text(json.dumps({"steps": steps, "val_loss": sums["loss_sum"] / sums["count"]}))


if __name__ == "__main__":
    main()
