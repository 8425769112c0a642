"""Train a byte-level language model data-parallel on N local workers with dptrain's DDP.

This is an ordinary torch DDP training script: the only dptrain-specific line is the
import of ``DistributedDataParallel`` (and of the sampler, which is torch-compatible).
The data needs no download: the corpus is the Python standard library's own source
code, present on every machine that runs Python.

    python examples/train_ddp.py --nproc 2                  # spawns 2 local workers
    torchrun --nproc-per-node 2 examples/train_ddp.py       # or let torchrun launch them

The model predicts the next byte from the previous ``--context`` bytes (an MLP over byte
embeddings, Bengio et al. 2003). Loss starts at ln(256) = 5.55 nats per byte and falls
to about 2 in 600 steps (half a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dptrain import BatchPlan, DistributedSampler, tune_cpu_allocator
from dptrain import DistributedDataParallel as DDP  # the drop-in for torch's DDP
from dptrain.tasks.corpus import stdlib_corpus


class NextByte(Dataset):
    """Sample i: bytes [i, i + context) as input, byte i + context as target."""

    def __init__(self, data: torch.Tensor, context: int):
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.data) - self.context

    def __getitem__(self, i: int):
        return self.data[i:i + self.context], self.data[i + self.context]


class ByteMLP(nn.Module):
    def __init__(self, context: int, embed: int = 48, hidden: int = 512):
        super().__init__()
        self.embed = nn.Embedding(256, embed)
        self.net = nn.Sequential(nn.Linear(context * embed, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, x):  # x: (B, T) bytes
        return self.net(self.embed(x).flatten(1))  # (B, 256) logits


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()  # CPU only: keep freed gradient memory instead of page-faulting it back
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    plan = BatchPlan.resolve(world_size, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch)
    corpus = stdlib_corpus(args.corpus_bytes)
    split = int(0.95 * len(corpus))
    train_set, val_set = NextByte(corpus[:split], args.context), NextByte(corpus[split:], args.context)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=plan.micro_batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = DDP(ByteMLP(args.context))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    log = print if rank == 0 else (lambda *a, **k: None)
    params = sum(p.numel() for p in model.parameters())
    log(f"{params / 1e6:.2f}M parameters, {world_size} workers, global batch {plan.global_batch_size} = "
        f"micro {plan.micro_batch_size} x world {world_size} x accum {plan.grad_accum_steps}, "
        f"{len(corpus) / 1e6:.1f} MB of stdlib source")

    step, batches, start = 0, iter(loader), time.perf_counter()
    while step < args.steps:
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro in range(plan.grad_accum_steps):
            x, y = next(batches)
            sync = micro == plan.grad_accum_steps - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                # The loss is a mean over the micro-batch; dividing by the accumulation
                # steps makes the accumulated gradient the mean over the global batch.
                loss = nn.functional.cross_entropy(model(x), y) / plan.grad_accum_steps
                loss.backward()
            step_loss += loss.item()
        optimizer.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            elapsed = time.perf_counter() - start
            comm = model.last_step_comm
            log(f"step {step:4d}  loss {step_loss:.3f} (rank 0's micro-batches)  "
                f"{step * plan.global_batch_size / elapsed:,.0f} samples/s  "
                f"{comm.calls} all-reduces, {comm.bytes / 1e6:.2f} MB/step")
    val_loss = evaluate(model, val_set, world_size, rank)
    log(f"validation loss {val_loss:.3f} nats/byte ({val_loss / math.log(2):.2f} bits/byte) "
        f"after {step} steps, {time.perf_counter() - start:.0f}s")
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, world_size: int, rank: int, samples: int = 4096) -> float:
    model.eval()
    idx = torch.arange(rank, min(samples, len(data)), world_size)
    x = torch.stack([data[int(i)][0] for i in idx])
    y = torch.stack([data[int(i)][1] for i in idx])
    total = torch.tensor([nn.functional.cross_entropy(model(x), y, reduction="sum").item(), float(len(idx))])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="local workers to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torchrun (or Slurm with these variables set)
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    mp.spawn(train, args=(args.nproc, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
