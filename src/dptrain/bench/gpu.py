"""GPU check: dptrain's DDP on one CUDA device with NCCL, against torch's DDP and no wrapper at all.

World size 1 is what one GPU allows (NCCL refuses two ranks on one device), and it is
the case where a wrapper's cost is easiest to see: the all-reduce is a local copy, so
every microsecond above the unwrapped model is the wrapper's own (bucket copies, hooks,
stream waits). Two checks:

- **parity**: the same GPT trained ``--parity-steps`` steps with AdamW under
  ``torch.nn.parallel.DistributedDataParallel`` and under ``dptrain.DistributedDataParallel``,
  same data, in fp32 and under bf16 autocast; the largest relative parameter difference;
- **overhead**: step time (forward, backward, optimizer step; CUDA-synchronised) of the
  unwrapped model, torch's DDP and dptrain's DDP (also with ``gradient_as_bucket_view``),
  under bf16 autocast, interleaved in a
  shuffled order per round; medians and the paired ratios over rounds.

End-to-end runs on the GPU (precisions, ZeRO) are ``dptrain run --nproc 1`` on a CUDA
machine; ``docs/gpu.md`` lists the ones checked, and ``docs/repro/gpu_check.sh`` runs them all.
``--device cpu`` runs the same steps on the CPU with gloo (autocast on the CPU, no CUDA
synchronisation): only a rehearsal of the command on a machine without a GPU, never a figure.

    python -m dptrain.bench.gpu --rounds 20
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dptrain import DistributedDataParallel
from dptrain.bench.results import save_result
from dptrain.bench.stats import paired_ratios
from dptrain.cli.bench_group import bench_command
from dptrain.launch.rendezvous import free_port, leave_process_groups
from dptrain.models.gpt import GPT

__all__ = ["parity", "overhead", "main"]


def _batch(step: int, batch: int, block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (batch, block + 1), generator=g).to(device)
    return x[:, :-1], x[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, optimizer, x, y, autocast: bool) -> float:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def parity(device: torch.device, steps: int, autocast: bool) -> dict:
    """Train the same GPT under torch's DDP and dptrain's; the largest relative parameter difference."""
    torch.manual_seed(0)
    base = GPT(n_layer=4, n_head=4, n_embd=256, block_size=128).to(device)
    theirs, ours = TorchDDP(copy.deepcopy(base)), DistributedDataParallel(copy.deepcopy(base))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (theirs, ours)]
    losses: list[tuple[float, float]] = []
    for step in range(steps):
        x, y = _batch(step, 16, 128, device)
        losses.append(tuple(_step(m, o, x, y, autocast) for m, o in zip((theirs, ours), opts, strict=True)))
    worst = max(((a - b).norm() / a.norm().clamp_min(1e-12)).item()
                for a, b in zip(theirs.module.parameters(), ours.module.parameters(), strict=True))
    return {"steps": steps, "autocast_bf16": autocast, "max_relative_param_diff": worst,
            "final_loss_torch": losses[-1][0], "final_loss_dptrain": losses[-1][1],
            "bitwise_equal": worst == 0.0}


def overhead(device: torch.device, rounds: int, steps: int, n_layer: int, n_embd: int, batch: int,
             block: int) -> dict:
    """Interleaved step times of the unwrapped model, torch's DDP and dptrain's DDP (bf16 autocast)."""
    torch.manual_seed(0)
    base = GPT(n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd, block_size=block).to(device)
    variants = {"plain": copy.deepcopy(base), "torch_ddp": TorchDDP(copy.deepcopy(base)),
                "dptrain_ddp": DistributedDataParallel(copy.deepcopy(base)),
                "dptrain_ddp_views": DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True)}
    fused = device.type == "cuda"  # the fused kernel is the GPU's fast path; the CPU rehearsal keeps the default
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused) for k, m in variants.items()}
    x, y = _batch(0, batch, block, device)
    for name, model in variants.items():  # warm-up: kernels, allocator, NCCL
        for _ in range(3):
            _step(model, opts[name], x, y, True)
    times: dict[str, list[list[float]]] = {k: [] for k in variants}
    order = list(variants)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            samples = []
            for _ in range(steps):
                _sync(device)
                t0 = time.perf_counter()
                _step(variants[name], opts[name], x, y, True)
                _sync(device)
                samples.append((time.perf_counter() - t0) * 1e3)
            times[name].append(samples)
    medians = {k: statistics.median(s for r in v for s in r) for k, v in times.items()}
    params = sum(p.numel() for p in base.parameters())
    return {"model": {"n_layer": n_layer, "n_embd": n_embd, "params": params, "batch": batch, "block": block},
            "rounds": rounds, "steps_per_round": steps, "median_ms": medians,
            "dptrain_vs_plain": paired_ratios(times["dptrain_ddp"], times["plain"]),
            "dptrain_vs_torch_ddp": paired_ratios(times["dptrain_ddp"], times["torch_ddp"]),
            "torch_ddp_vs_plain": paired_ratios(times["torch_ddp"], times["plain"]),
            "dptrain_views_vs_torch_ddp": paired_ratios(times["dptrain_ddp_views"], times["torch_ddp"])}


@bench_command(__doc__)
@click.option("--rounds", type=int, default=20, help="rounds; each times every variant in a shuffled order")
@click.option("--steps", type=int, default=5, help="timed steps per variant per round")
@click.option("--parity-steps", type=int, default=20, help="AdamW steps of the parity check against torch's DDP")
@click.option("--n-layer", type=int, default=12, help="the timed GPT's blocks")
@click.option("--n-embd", type=int, default=768, help="the timed GPT's width")
@click.option("--batch", type=int, default=16, help="sequences per step")
@click.option("--block", type=int, default=512, help="tokens per sequence")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_results/gpu.json"),
              help="the JSON result to write")
@click.option("--device", "device_type", type=click.Choice(["cuda", "cpu"]), default="cuda",
              help="cuda (NCCL), or cpu (gloo): a rehearsal of the command where there is no GPU, not a measurement")
def main(rounds: int, steps: int, parity_steps: int, n_layer: int, n_embd: int, batch: int, block: int,
         out: Path, device_type: str) -> None:
    device = _join(device_type)
    try:
        result = {"device": _device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                  "backend": dist.get_backend()}
        result["parity"] = [parity(device, parity_steps, autocast) for autocast in (False, True)]
        for p in result["parity"]:
            print(f"parity ({'bf16 autocast' if p['autocast_bf16'] else 'fp32'}, {p['steps']} steps): "
                  f"max relative parameter difference {p['max_relative_param_diff']:.3g}; final loss torch "
                  f"{p['final_loss_torch']:.4f}, dptrain {p['final_loss_dptrain']:.4f}")
        o = overhead(device, rounds, steps, n_layer, n_embd, batch, block)
        result["overhead"] = o
        print(f"overhead ({o['model']['params'] / 1e6:.1f}M parameters, batch {batch}x{block}, bf16): "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in o["median_ms"].items()))
        for key in ("dptrain_vs_plain", "dptrain_vs_torch_ddp", "torch_ddp_vs_plain", "dptrain_views_vs_torch_ddp"):
            r = o[key]
            print(f"  {key}: {r['median']:.4f}x (90% CI {r['ci90'][0]:.4f}-{r['ci90'][1]:.4f})")
        save_result(out, result)
    finally:
        leave_process_groups()


def _join(device_type: str) -> torch.device:
    """One rank's process group on ``device_type``: NCCL bound to GPU 0, or gloo on the CPU."""
    if device_type == "cpu":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("dptrain bench gpu needs a CUDA device; this machine has none (torch.cuda.is_available() "
                         "is False). --device cpu rehearses the command on the CPU")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    return device


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (rehearsal, not a measurement)"


if __name__ == "__main__":
    main()
