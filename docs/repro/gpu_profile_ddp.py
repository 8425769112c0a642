"""Where a DDP step's time goes on one GPU, dptrain's beside torch's: torch.profiler over 5 steps of each.

    python docs/repro/gpu_profile_ddp.py > profile.txt      # on a CUDA machine

The model and batch are ``dptrain bench gpu``'s overhead set-up (12-layer GPT, 85.6M
parameters, batch 16 x 512, bf16 autocast, fused AdamW). Prints each wrapper's top
operators by CPU and by CUDA time. ``--json PATH`` also writes the figures the GPU check
compares (docs/repro/gpu_check.sh): each wrapper's self CPU time per step, and per step
and parameter tensor, since the wrappers' own costs (gradient hooks, bucket copies) are
paid once per parameter. ``--traces DIR`` writes the Chrome traces (tens of MB each at
this size). ``--device cpu`` (gloo) with small ``--n-layer``/``--n-embd``/``--batch``/``--block``
rehearses the script where there is no GPU; its figures say nothing about a GPU.
``bench_results/gpu/profile_ddp_overhead.txt`` is one run's output, read in docs/gpu.md ("Why").
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

from dptrain import DistributedDataParallel
from dptrain.bench.gpu import _batch, _join, _step, _sync
from dptrain.models.gpt import GPT


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="profiled steps per wrapper (after as many warm-up steps)")
    p.add_argument("--json", type=Path, default=None, help="write the per-step and per-parameter figures here")
    p.add_argument("--traces", type=Path, default=None, help="write each wrapper's Chrome trace into this folder")
    return p.parse_args()


def _figures(prof, steps: int, n_tensors: int) -> dict:
    """Self CPU (and CUDA) time per step and per step and parameter tensor; the top operators by self CPU time."""
    events = prof.key_averages()
    cpu_us = sum(e.self_cpu_time_total for e in events)
    cuda_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"steps": steps, "param_tensors": n_tensors,
            "self_cpu_ms_per_step": cpu_us / steps / 1e3, "self_device_ms_per_step": cuda_us / steps / 1e3,
            "self_cpu_us_per_param_per_step": cpu_us / steps / n_tensors,
            "calls_per_step": {name: sum(e.count for e in events if e.key == name) / steps
                               for name in ("aten::copy_", "cudaMemcpyAsync", "cudaLaunchKernel")},
            "top_self_cpu": [{"op": e.key, "self_cpu_us_per_step": e.self_cpu_time_total / steps,
                              "calls_per_step": e.count / steps} for e in top]}


def main() -> None:
    args = _args()
    device = _join(args.device)
    torch.manual_seed(0)
    base = GPT(n_layer=args.n_layer, n_head=max(1, args.n_embd // 64), n_embd=args.n_embd,
               block_size=args.block).to(device)
    n_tensors = sum(1 for _ in base.parameters())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (rehearsal)",
              "torch": torch.__version__, "params": sum(p.numel() for p in base.parameters()),
              "batch": args.batch, "block": args.block, "wrappers": {}}
    for name, model in (("torch", TorchDDP(copy.deepcopy(base))), ("dptrain", DistributedDataParallel(base))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        x, y = _batch(0, args.batch, args.block, device)
        for _ in range(args.steps):  # warm-up
            _step(model, optimizer, x, y, True)
        _sync(device)
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                _step(model, optimizer, x, y, True)
            _sync(device)
        print("=====", name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if device.type == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
        if args.traces is not None:
            args.traces.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.traces / f"trace_{name}.json"))
        result["wrappers"][name] = _figures(prof, args.steps, n_tensors)
    ours, theirs = (result["wrappers"][k]["self_cpu_us_per_param_per_step"] for k in ("dptrain", "torch"))
    result["dptrain_minus_torch_cpu_us_per_param_per_step"] = ours - theirs
    print(f"self CPU time per step and parameter tensor ({n_tensors} tensors): dptrain {ours:.1f} us, "
          f"torch DDP {theirs:.1f} us, difference {ours - theirs:+.1f} us")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
