"""The harness of the CPU ports of torch's GPU-only DDP tests (tests/test_ddp_ports*.py, issue 41).

Each case runs on 2 gloo ranks, twice per rank: once with torch's ``DistributedDataParallel``
and once with dptrain's, from the same initial replicas and the same per-rank data; every
step's gradients, parameters, outputs and exceptions are recorded, and the two records must
be equal, bitwise (tests/test_ddp_ports.py says why that is the right bar). One spawn per
group of cases (:func:`group_results`), reported case by case by pytest.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.testing import run_on_ranks

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
TINY_BUCKETS = 0.0004  # MiB: several buckets even for these small models (torch's test uses 1 MiB on bigger ones)

Record = list[tuple[str, object]]


# ------------------------------------------------------------------ the comparison harness

def snapshot(tag: str, model: nn.Module, what: str = "grad", none_as_zero: bool = False) -> Record:
    """Each parameter's gradient (``what="grad"``; a missing one as zeros with ``none_as_zero``) or value, and
    with values the buffers, cloned."""
    if what == "grad":
        return [(f"{tag} grad {n}", p.grad.detach().clone() if p.grad is not None
                 else torch.zeros_like(p) if none_as_zero else None) for n, p in model.named_parameters()]
    return ([(f"{tag} param {n}", p.detach().clone()) for n, p in model.named_parameters()]
            + [(f"{tag} buffer {n}", b.detach().clone()) for n, b in model.named_buffers()])


def sgd_step(model: nn.Module, lr: float = 0.1) -> None:
    """torch's ``_model_step`` with a learning rate: p -= lr * grad, then grad = None."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
            p.grad = None


def raised(exc: BaseException) -> tuple[str, object]:
    return ("raised", f"{type(exc).__name__}: {exc}")


def _differ(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)
    return a != b


def compare(torchs: Record, ours: Record) -> dict:
    """Where two records first differ (``None``: equal), and whether training moved anything at all."""
    first = None
    if [k for k, _ in torchs] != [k for k, _ in ours]:
        first = f"different records: torch {[k for k, _ in torchs][:6]}... dptrain {[k for k, _ in ours][:6]}..."
    else:
        for (key, a), (_, b) in zip(torchs, ours, strict=True):
            if _differ(a, b):
                first = f"{key}: torch {a!r} dptrain {b!r}"
                break
    seen: dict[str, torch.Tensor] = {}
    moved = False
    for key, value in torchs:  # a parameter whose value differs between two of its snapshots
        if " param " in key:
            name = key.split(" param ", 1)[1]
            moved = moved or (name in seen and not torch.equal(seen[name], value))
            seen[name] = value
    return {"entries": len(torchs), "first_difference": first, "moved": moved}


def run_cases(rank: int, world_size: int, module: str, names: list[str]) -> dict[str, dict]:
    """On each rank, every case of ``names`` with torch's wrapper, then with dptrain's; their records compared."""
    cases = __import__(module).CASES
    results = {}
    for name in names:
        try:
            torchs = cases[name](rank, world_size, TORCH_DDP)
        except Exception as exc:  # torch itself cannot run this case here: reported as a skip
            results[name] = {"torch_cannot": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        try:
            ours = cases[name](rank, world_size, DistributedDataParallel)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            continue
        results[name] = compare(torchs, ours)
    return results


def check_case(results: list[dict], name: str, expect_moved: bool = True) -> None:
    for rank, per_rank in enumerate(results):
        result = per_rank[name]
        if "torch_cannot" in result:
            pytest.skip(f"torch's own DDP cannot run this on CPU/gloo: {result['torch_cannot']}")
        assert "error" not in result, f"rank {rank}: dptrain raised where torch did not:\n{result['error']}"
        assert result["entries"] > 0, f"rank {rank}: nothing was recorded"
        assert result["first_difference"] is None, f"rank {rank}: {result['first_difference']}"
        if expect_moved:
            assert result["moved"], f"rank {rank}: the parameters never changed: the case tests nothing"


def group_results(request, module: str, names: list[str], timeout: float = 120) -> list[dict]:
    """One spawn per group and pytest session, shared by the group's parametrized cases."""
    cache = request.config.stash.setdefault(_CACHE, {})
    if module not in cache:
        cache[module] = run_on_ranks(run_cases, 2, module, names, timeout=timeout)
    return cache[module]


_CACHE = pytest.StashKey[dict]()


def rank_input(rank: int, step: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * rank + step))


# a model both groups use (torch's, smaller)

class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x):
        x = self.bn(self.fc1(x).reshape(-1, 4, 10)).reshape(-1, 40)  # (B, 4, 10) normalised per channel
        return F.softmax(self.fc2(x), dim=1)
