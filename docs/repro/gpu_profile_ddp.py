"""Where a DDP step's time goes on one GPU, dptrain's beside torch's: torch.profiler over 5 steps of each.

    python docs/repro/gpu_profile_ddp.py > profile.txt      # on a CUDA machine

The model and batch are ``dptrain bench gpu``'s overhead set-up (12-layer GPT, 85.6M
parameters, batch 16 x 512, bf16 autocast, fused AdamW). Prints each wrapper's top
operators by CPU and by CUDA time and writes their Chrome traces to ``$OUT`` (or the
current directory). ``bench_results/gpu/profile_ddp_overhead.txt`` is one run's output,
read in docs/gpu.md ("Why").
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

from dptrain import DistributedDataParallel
from dptrain.bench.gpu import _batch, _step
from dptrain.launch.rendezvous import free_port
from dptrain.models.gpt import GPT


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    torch.manual_seed(0)
    base = GPT(n_layer=12, n_head=12, n_embd=768, block_size=512).to(device)
    out = os.environ.get("OUT", ".")
    for name, model in (("torch", TorchDDP(copy.deepcopy(base))), ("dptrain", DistributedDataParallel(base))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x, y = _batch(0, 16, 512, device)
        for _ in range(5):  # warm-up
            _step(model, optimizer, x, y, True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                _step(model, optimizer, x, y, True)
            torch.cuda.synchronize()
        print("=====", name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
        prof.export_chrome_trace(f"{out}/trace_{name}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
