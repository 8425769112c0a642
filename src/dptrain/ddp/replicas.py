"""Keeping replicas identical: verify they have the same structure, broadcast their state.

Data parallelism is correct only if every rank starts from the same parameters and
steps with the same gradients. These helpers run at construction (and for buffers,
before each forward): :func:`verify_replicas` checks that every rank wrapped the same
model (same parameter names, shapes, dtypes, ``requires_grad``), and
:func:`broadcast_coalesced` copies rank ``src``'s tensors to every rank with one
broadcast per (dtype, device) group instead of one per tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["ReplicaMismatchError", "verify_replicas", "broadcast_coalesced", "tensor_signature"]


class ReplicaMismatchError(ValueError, RuntimeError):
    """Ranks wrapped models that differ in structure (torch's DDP raises ``RuntimeError``)."""


def tensor_signature(named_tensors: Iterable[tuple[str, torch.Tensor]], kind: str) -> list[tuple]:
    """``(kind, name, shape, dtype, requires_grad)`` for each tensor, in order."""
    return [(kind, name, tuple(t.shape), str(t.dtype), bool(t.requires_grad)) for name, t in named_tensors]


def verify_replicas(signature: list[tuple], group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank if the ranks' signatures differ.

    Cheap in the common case: one all-gather of an 8-byte digest. Only on a mismatch
    are the full signatures gathered, to name the first differing tensor. ``device``
    is where the group's backend communicates (CUDA for NCCL).
    """
    digest = hashlib.sha256(repr(signature).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if all(int(g) == int(mine) for g in gathered):
        return
    signatures: list = [None] * world
    dist.all_gather_object(signatures, signature, group=group)
    raise ReplicaMismatchError(_describe_mismatch(signatures))


def _describe_mismatch(signatures: list[list[tuple]]) -> str:
    reference = signatures[0]
    for rank, sig in enumerate(signatures[1:], start=1):
        for i in range(max(len(reference), len(sig))):
            a = reference[i] if i < len(reference) else None
            b = sig[i] if i < len(sig) else None
            if a != b:
                return (f"model replicas differ between rank 0 and rank {rank} at "
                        f"{_describe_entry(a, b)}. Every rank must construct the same model "
                        "(same architecture, same order of submodules, same dtypes) before "
                        "wrapping it.")
    return "model replicas differ across ranks"


def _describe_entry(a: tuple | None, b: tuple | None) -> str:
    if a is None or b is None:
        present = a or b
        side = "rank 0 has" if a else "rank 0 lacks"
        return f"{present[0]} {present[1]!r}: {side} it, the other does not"
    kind, name = a[0], a[1]
    if kind == "option":
        return f"option {name}={a[2]!r} (nodes {a[3]}) on rank 0 vs {b[2]!r} (nodes {b[3]})"
    if a[1] != b[1]:
        return f"{kind} #{name!r} vs {b[1]!r}: names differ (modules registered in a different order?)"
    fields = [("shape", 2), ("dtype", 3), ("requires_grad", 4)]
    diffs = [f"{label} {a[i]} on rank 0 vs {b[i]}" for label, i in fields if a[i] != b[i]]
    return f"{kind} {name!r}: " + ", ".join(diffs)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup) -> tuple[int, int]:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place.

    Tensors are flattened into one buffer per (dtype, device), so a model's state costs a
    handful of broadcasts. Returns ``(calls, bytes)`` communicated.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    calls = nbytes = 0
    src_global = dist.get_global_rank(group, src) if group is not None and group != dist.group.WORLD else src
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            dist.broadcast(flat, src=src_global, group=group)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            calls += 1
            nbytes += flat.numel() * flat.element_size()
    return calls, nbytes
