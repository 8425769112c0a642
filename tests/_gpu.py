"""What the GPU tests share: where they run, the skip, and one rank on the device.

The GPU tests (``tests/test_gpu*.py``, marked ``gpu``) run on one CUDA device at world size 1
with NCCL: one GPU is all a lent machine has, and NCCL refuses two ranks on one device.
Without CUDA they skip, with the reason. ``DPTRAIN_GPU_CHECK_DRY=1`` runs the same test
bodies on the CPU with gloo (fp16 cases skipped: the loss scaler's path is CUDA's): that is
how ``docs/repro/gpu_check.sh`` is rehearsed where no GPU is lent (docs/gpu.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from dptrain.testing import run_on_ranks

DRY = os.environ.get("DPTRAIN_GPU_CHECK_DRY") == "1"
DEVICE_TYPE = "cpu" if DRY else "cuda"
BACKEND = "gloo" if DRY else "nccl"

needs_gpu = pytest.mark.skipif(not DRY and not torch.cuda.is_available(),
                               reason="needs a CUDA device (torch.cuda.is_available() is False); "
                                      "DPTRAIN_GPU_CHECK_DRY=1 runs the same test on the CPU with gloo")
not_dry = pytest.mark.skipif(DRY, reason="fp16 with the loss scaler is CUDA's path: the dry run on the CPU leaves "
                                         "it out")


def rank_device(device_type: str) -> torch.device:
    """This rank's device: GPU 0 (made current, as NCCL needs), or the CPU in the dry run."""
    if device_type == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def on_one_rank(fn, *args, timeout: float = 150.0):
    """``fn(rank, world_size, DEVICE_TYPE, *args)`` on one rank with the check's backend; its result."""
    return run_on_ranks(fn, 1, DEVICE_TYPE, *args, backend=BACKEND, timeout=timeout)[0]


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (L2 norms, in fp32): 0 when bitwise equal."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
