"""What ``dptrain env`` reports for bug reports: versions, backends, cores, devices."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["collect_env", "format_env"]

_PACKAGES = ("dptrain", "torch", "numpy", "click", "tqdm", "matplotlib", "safetensors")


def collect_env() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "executable": sys.executable,
        "packages": {name: _version(name) for name in _PACKAGES},
        "cpu": {"logical_cores": os.cpu_count(),
                "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "torch_threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()},
        "distributed": {"available": dist.is_available(),
                        "gloo": dist.is_available() and dist.is_gloo_available(),
                        "nccl": dist.is_available() and dist.is_nccl_available(),
                        "mpi": dist.is_available() and dist.is_mpi_available()},
        "cuda": {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                 "devices": []},
        "bf16_on_cpu": _bf16_cpu(),
        "launcher_env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                                    "SLURM_PROCID", "SLURM_NTASKS", "OMP_NUM_THREADS")
                         if k in os.environ},
    }
    if torch.cuda.is_available():
        info["cuda"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["cuda"]["devices"].append({"index": i, "name": props.name,
                                            "memory_gib": round(props.total_memory / 2**30, 1),
                                            "capability": f"{props.major}.{props.minor}",
                                            "bf16": torch.cuda.is_bf16_supported()})
    return info


def format_env(info: dict[str, Any]) -> str:
    lines = [f"python       {info['python']} ({info['executable']})", f"platform     {info['platform']}"]
    lines.append("packages     " + ", ".join(f"{k} {v}" for k, v in info["packages"].items()))
    cpu = info["cpu"]
    lines.append(f"cpu          {cpu['logical_cores']} logical cores ({cpu['usable_cores']} usable), "
                 f"torch threads {cpu['torch_threads']}, {cpu['processor']}")
    backends = [name for name in ("gloo", "nccl", "mpi") if info["distributed"][name]]
    lines.append(f"backends     {', '.join(backends) or 'none (torch.distributed unavailable)'}")
    cuda = info["cuda"]
    if cuda["available"]:
        lines.append(f"cuda         torch built for {cuda['torch_cuda']}, NCCL {cuda.get('nccl')}")
        for d in cuda["devices"]:
            lines.append(f"  cuda:{d['index']}     {d['name']}, {d['memory_gib']} GiB, sm {d['capability']}, "
                         f"bf16 {'yes' if d['bf16'] else 'no'}")
    else:
        lines.append(f"cuda         not available (torch built for {cuda['torch_cuda'] or 'CPU only'})")
    lines.append(f"bf16 on cpu  {'yes' if info['bf16_on_cpu'] else 'no'}")
    if info["launcher_env"]:
        lines.append("launcher     " + " ".join(f"{k}={v}" for k, v in info["launcher_env"].items()))
    return "\n".join(lines)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _bf16_cpu() -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16)
        return bool((a @ a).sum().item() == 8)
    except RuntimeError:
        return False
