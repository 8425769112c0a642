"""nanoGPT's training loop, compiled, with torch's DDP and with dptrain's: the same losses? (issue 48)

nanoGPT's ``train.py`` needs CUDA (it calls ``torch.cuda.set_device``), so this runs its loop as written
there, on 2 gloo ranks, with its own ``model.py`` (``GPT``, ``configure_optimizers``, ``estimate_mfu``):
``torch.compile(model)`` (``compile=True``, its default) then ``DDP(model)``, each rank seeded
``1337 + rank`` (DDP's construction broadcast makes the replicas equal), gradient accumulation through
``model.require_backward_grad_sync``, the loss divided by the accumulation steps, a clip at 1.0, AdamW,
``raw_model = model.module`` and ``raw_model.estimate_mfu(...)``. Batches are random tokens drawn with
the rank's generator, as ``get_batch`` draws its offsets. Each class runs in fresh processes (dynamo's
cache is per process), and prints its losses, the compiled pieces its first output's graph holds
(dynamo's DDPOptimizer split) and dynamo's graph-break count.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    python docs/repro/nanogpt_compiled.py --nanogpt /tmp/nanoGPT                 # inductor, as nanoGPT
    python docs/repro/nanogpt_compiled.py --nanogpt /tmp/nanoGPT --backend aot_eager
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.testing import run_on_ranks

CONFIG = dict(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab_size=65, bias=False, dropout=0.0)
BATCH, ACCUM, LR, WARMUP = 4, 2, 6e-4, 2


def _compiled_pieces(output: torch.Tensor) -> int:
    seen, frontier, count = set(), [output.grad_fn], 0
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "Compiled" in type(node).__name__
        frontier.extend(n for n, _ in node.next_functions)
    return count


def _train(rank: int, world_size: int, which: str, nanogpt: str, iters: int, backend: str) -> dict:
    sys.path.insert(0, nanogpt)
    from model import GPT, GPTConfig  # nanoGPT's model.py
    from torch._dynamo.utils import counters

    torch.manual_seed(1337 + rank)  # train.py: seed_offset = ddp_rank
    data = torch.randint(0, CONFIG["vocab_size"], (50_000,), generator=torch.Generator().manual_seed(0))

    def get_batch():
        ix = torch.randint(len(data) - CONFIG["block_size"], (BATCH,))
        x = torch.stack([data[i:i + CONFIG["block_size"]] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + CONFIG["block_size"]] for i in ix])
        return x, y

    model = GPT(GPTConfig(**CONFIG))
    optimizer = model.configure_optimizers(0.1, LR, (0.9, 0.95), "cpu")
    if backend != "none":
        model = torch.compile(model, backend=backend)
    ddp = nn.parallel.DistributedDataParallel if which == "torch" else DistributedDataParallel
    model = ddp(model)  # train.py passes device_ids=[local_rank]: a CUDA device, which torch refuses for a CPU module
    raw_model = model.module  # unwrap DDP container if needed
    losses, pieces, mfu = [], None, None
    x, y = get_batch()
    start = time.perf_counter()
    for it in range(iters):
        lr = LR * (it + 1) / (WARMUP + 1) if it < WARMUP else LR
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro_step in range(ACCUM):
            model.require_backward_grad_sync = micro_step == ACCUM - 1
            logits, loss = model(x, y)
            if pieces is None:
                pieces = _compiled_pieces(loss)
            loss = loss / ACCUM  # scale the loss to account for gradient accumulation
            x, y = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * ACCUM)
        mfu = raw_model.estimate_mfu(BATCH * ACCUM, 1.0)
    return {"losses": losses, "pieces": pieces, "graph breaks": sum(counters["graph_break"].values()),
            "mfu": mfu, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", required=True, help="a checkout of github.com/karpathy/nanoGPT")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "none"])
    args = parser.parse_args()
    runs = {which: run_on_ranks(_train, 2, which, args.nanogpt, args.iters, args.backend, timeout=1800)
            for which in ("torch", "dptrain")}
    for which, ranks in runs.items():
        r = ranks[0]
        print(f"{which:8s} losses {' '.join(f'{v:.6f}' for v in r['losses'])}  compiled pieces {r['pieces']}  "
              f"graph breaks {r['graph breaks']}  estimate_mfu through .module {r['mfu']:.2e}  {r['seconds']:.0f} s")
    theirs, ours = runs["torch"][0]["losses"], runs["dptrain"][0]["losses"]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(theirs, ours, strict=True))
    same = theirs == ours
    print(f"losses {'bitwise equal' if same else f'differ, worst relative difference {worst:.2e}'} "
          f"({args.backend}, {args.iters} iterations, rank 0); finite: {all(math.isfinite(v) for v in ours)}")


if __name__ == "__main__":
    main()
