"""Your own training loop on dptrain's Engine: accumulation, clipping, LR schedule, bf16.

    dptrain launch --nproc 2 examples/custom_loop.py                     # 2 workers
    torchrun --standalone --nproc-per-node 2 examples/custom_loop.py    # the same, under torchrun
    python examples/custom_loop.py                                       # 1 process

The Engine owns what every data-parallel step needs and you would otherwise get wrong:
gradient sync only on the last micro-step, loss scaling for accumulation, global-norm
clipping, the LR schedule, skipping non-finite steps on all ranks together. You keep
the model, the data, the loss and the loop. See docs/api.md.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dptrain


def main() -> None:
    dptrain.tune_cpu_allocator()           # CPU training: keep glibc from returning memory every step
    device = dptrain.init_distributed()    # torchrun, Slurm, or a single process
    rank, world = dist.get_rank(), dist.get_world_size()

    # Data: 4,096 points in 8 Gaussian clusters (generated, no download).
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(8, 16, generator=g) * 2
    labels = torch.randint(0, 8, (4096,), generator=g)
    dataset = TensorDataset(centers[labels] + torch.randn(4096, 16, generator=g), labels)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.01)
    plan = dptrain.BatchPlan.resolve(world, global_batch_size=128, micro_batch_size=32)  # accum = 4 / world
    steps = 60
    peak = dptrain.scaled_lr(3e-3, "sqrt", plan.global_batch_size, base_batch_size=64)
    engine = dptrain.Engine(model, optimizer, plan, precision="bf16", grad_clip=1.0,
                            lr_at=lambda s: dptrain.warmup_cosine(s, peak, 5, steps, 0.1))

    batches = engine.loader(dataset, seed=0).micro_batches()
    for _ in range(steps):
        for x, y in engine.micro_steps(batches):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(x), y)
            engine.backward(loss)
        info = engine.step()
        if rank == 0 and info.step % 10 == 0:
            comm = engine.model.last_step_comm
            print(f"step {info.step:3d}  loss {info.loss:.4f}  lr {info.lr:.2e}  grad norm {info.grad_norm:.3f}  "
                  f"{comm.bytes / 1e3:.1f} kB all-reduced in {comm.calls} bucket(s)")
    if rank == 0:
        print(f"global batch {plan.global_batch_size} = micro {plan.micro_batch_size} x {world} ranks x "
              f"{plan.grad_accum_steps} accum; skipped steps: {engine.skipped_steps}")
    dptrain.leave_process_groups()    # destroys the group and frees gloo's threads before the interpreter exits


if __name__ == "__main__":
    main()
