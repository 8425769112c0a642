"""The devices a plan is checked against, in GiB, and the headroom kept free on them.

One table for ``dptrain plan --device-memory`` and ``dptrain explore``'s device menu, so
a device fits in both or in neither. Memory is counted in GiB (2**30 bytes), as the
device's memory is: NVIDIA sells the H100 as "80 GB" and its driver (NVML, what
``nvidia-smi`` prints) reports 81,559 MiB, 79.65 GiB. Each preset is that reported total
(Modal's table, https://thundergolfer.com/blog/nvidia-gpu-memory-capacity).

"Fits" means the plan's total is at most the device's memory less a **headroom**, a
share of it kept for what the plan does not count: the CUDA context (about half a GiB
per process), NCCL's buffers, the caching allocator's fragmentation and kernel
workspaces. On this project's CPU measurements the plan was within 1% in fp32 for the
DDP engine but under-predicted bf16 peaks by 5-15% (docs/planner.md), so the default
keeps 10% free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Device", "DEVICES", "DEFAULT_HEADROOM", "GiB", "device_bytes", "check_headroom", "usable_bytes", "fits",
           "budget_line"]

GiB = 2**30
DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Device:
    """A device preset: its name on the command line, its label, and its memory as the driver reports it."""

    name: str
    label: str
    mib: int

    @property
    def bytes(self) -> int:
        return self.mib * 2**20

    @property
    def gib(self) -> float:
        return self.bytes / GiB


DEVICES = {d.name: d for d in (
    Device("h100", "H100 80GB", 81_559),
    Device("a100-80gb", "A100 80GB", 81_920),
    Device("h200", "H200 141GB", 143_771),
    Device("a10", "A10 24GB", 23_028),
)}


def device_bytes(text: str) -> int:
    """``--device-memory``: a preset's name (:data:`DEVICES`) or a positive number of GiB, as bytes.

    A ValueError names the presets and the unit otherwise.
    """
    name = str(text).strip().lower()
    if name in DEVICES:
        return DEVICES[name].bytes
    try:
        gib = float(name)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        presets = ", ".join(f"{d.name} ({d.gib:.2f} GiB)" for d in DEVICES.values())
        raise ValueError(f"--device-memory must be positive GiB, got {text}; or name a device: {presets}")
    return int(gib * GiB)


def check_headroom(headroom: float) -> float:
    """A headroom is a share of the device in [0, 1); a ValueError saying so otherwise."""
    if not (math.isfinite(headroom) and 0 <= headroom < 1):
        raise ValueError(f"--headroom is the share of device memory kept free, from 0 to below 1 (0.1 = 10%), got "
                         f"{headroom:g}")
    return headroom


def usable_bytes(device: int, headroom: float) -> int:
    """What a plan's total may reach on a device of ``device`` bytes with ``headroom`` of it kept free."""
    return int(device * (1 - headroom))


def fits(total: int, device: int, headroom: float) -> bool:
    return total <= usable_bytes(device, headroom)


def budget_line(device: int, headroom: float) -> str:
    """What "fits" compares against, in words: the device, the headroom, what is left."""
    return (f"fits: the total against {usable_bytes(device, headroom) / GiB:.2f} GiB, the device's "
            f"{device / GiB:.2f} GiB less a {100 * headroom:g}% headroom (--headroom) for what the plan does not "
            "count: the CUDA context, NCCL's buffers, the allocator's fragmentation, kernel workspaces")
