"""An ordinary PyTorch training script made data-parallel with dptrain.prepare(), as with Accelerate.

    dptrain launch --nproc 2 examples/prepare_loop.py                     # 2 workers
    torchrun --standalone --nproc-per-node 2 examples/prepare_loop.py    # the same, under torchrun
    python examples/prepare_loop.py                                       # 1 process

The model, optimizer, DataLoader and LR scheduler are built as for one process; prepare()
wraps them: the model in dptrain's DDP (or ZeRO with --strategy zero2), the loader over this
rank's shard (reshuffled each epoch, batches on the device), the optimizer and scheduler so
that they act once per accumulation window. The loop below is the single-process one.
See docs/api.md.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import dptrain


def clusters(samples: int, seed: int) -> TensorDataset:
    """Points around 8 Gaussian centres in 16 dimensions, labelled by centre (generated, no download)."""
    centres = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 2
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 8, (samples,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(samples, 16, generator=g), labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "zero2", "zero3"])
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    dptrain.tune_cpu_allocator()           # CPU training: keep glibc from returning memory every step
    device = dptrain.init_distributed()    # torchrun, Slurm, or a single process
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = max(1, 4 // world)             # 32 a rank x 4 micro-steps on 1 rank, x 2 on 2: global batch 128

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    train = DataLoader(clusters(4096, seed=1), batch_size=32, shuffle=True)
    val = DataLoader(clusters(1024, seed=2), batch_size=256)
    # A prepared scheduler steps once per process per optimizer step (as Accelerate's): epochs x len(train) / accum,
    # as one process counts it. The helper counts it exactly (the shards' padding, the epoch's last window).
    steps_per_epoch = dptrain.scheduler_steps_per_epoch(train, grad_accum_steps=accum)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.epochs * steps_per_epoch)

    model, optimizer, train, val, scheduler = dptrain.prepare(
        model, optimizer, train, val, scheduler,
        strategy=args.strategy, precision=args.precision, grad_accum_steps=accum, grad_clip=1.0)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        total, count = torch.zeros((), device=device), 0
        for x, y in train:                 # this rank's shard, reshuffled each epoch
            loss = F.cross_entropy(model(x), y)
            loss.backward()                # no all-reduce inside an accumulation window
            optimizer.step()               # these three act only when the window closes
            scheduler.step()
            optimizer.zero_grad()
            total += loss.detach()
            count += 1
        model.eval()
        correct = torch.zeros((), device=device)
        with torch.no_grad():              # evaluation forwards are not accumulation micro-steps
            for x, y in val:
                correct += (model(x).argmax(-1) == y).sum()
        stats = torch.stack([total / count, correct])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}  loss {stats[0].item() / world:.4f}  val accuracy {stats[1].item() / 1024:.3f}  "
                  f"lr {scheduler.get_last_lr()[0]:.2e}  grad norm {optimizer.grad_norm:.3f}")
    if rank == 0:
        print(f"{optimizer.steps} optimizer steps ({scheduler.last_epoch} scheduler steps) of global batch "
              f"{32 * world * accum} = 32 x {world} ranks x {accum} accum; {args.strategy} {args.precision}; "
              f"{time.perf_counter() - start:.1f} s")
    dptrain.leave_process_groups()        # frees gloo's threads before exit (a bare destroy can SIGABRT)


if __name__ == "__main__":
    main()
